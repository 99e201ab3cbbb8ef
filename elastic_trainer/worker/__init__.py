"""What runs inside every worker process: the ``TrainingSession`` a script uses, the elastic
sampler, the worker's context (what it learns from its environment), process-group set-up,
the in-memory snapshot tier (``memory``), and ``bootstrap``, the first code every worker runs.

Nothing here imports the supervisor: a worker talks to it only through the contract
(``elastic_trainer.contract``: environment, control files, exit codes, events).
"""
