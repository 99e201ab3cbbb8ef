"""The supervisor: one process per node, on torch.distributed.elastic's agent.

``run`` turns argv into an exit code; ``agent`` is the elastic agent with our loop. Its parts:
``core`` (pure decisions), ``rendezvous`` (meeting the other nodes), ``processes`` (the
workers and the sentinel), ``warm`` (the warm pool, a fork server of its own), ``cli`` (the
command line to a ``RunConfig``), ``metrics_server`` (``--metrics-port``) and ``finished``
(the record of a finished job in its run folder).
"""
