"""Every process elastic-train starts, one module each: what runs in which process.

======================  =======================================  ===============================
process                 entry                                    started by
======================  =======================================  ===============================
supervisor (one/node)   ``elastic-train``: ``cli.py``            the user, Slurm, systemd, k8s
node sentinel           ``entrypoints/sentinel.py``              the supervisor (``procs``)
warm pool               ``entrypoints/warm_pool.py``             the supervisor (``warm``)
preflight child         ``entrypoints/preflight.py``             the supervisor, or a pool fork
worker                  ``entrypoints/worker.py`` (bootstrap)    the supervisor, or a pool fork
snapshot writer         ``snapshots/write/writer_child.py``      a worker's ``SnapshotStore``
======================  =======================================  ===============================

These modules sit above ``supervisor`` and ``worker``: a process that is started by one side
and runs the other's code (the warm pool forks workers) is wired here, so neither side
imports the other. The snapshot writer belongs to the ``snapshots`` library, which stands
alone. docs/development.md draws the processes and what crosses between them.
"""
