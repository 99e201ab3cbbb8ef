"""The warm pool: a fork server that has imported torch once (``pool``, its own process),
the supervisor's handle on it (``launcher``: start it, ask it for forks), a fork as the
supervisor holds it (``process``) and torch's ``start_processes`` on it (``client``).
"""
