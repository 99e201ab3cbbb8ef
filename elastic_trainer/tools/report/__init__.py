"""``elastic-train report``: read a run's JSON event log, summarise it, draw it.

``cli`` is the command, ``events`` reads (I/O), ``summary`` is pure, ``plot`` draws with
matplotlib's Agg backend.
"""
