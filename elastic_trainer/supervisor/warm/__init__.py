"""The warm pool: a fork server that has imported torch once (``pool``, its own process)
and the supervisor's client of it (``client``).
"""
