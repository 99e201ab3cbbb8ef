"""The operator's commands beside the supervisor: ``status``, ``report`` and the
standalone rendezvous ``store``. Each runs in its own short-lived process.
"""
