"""The supervisor's pure decisions: restart policy, recovery and goodput bookkeeping, the hang
watchdog's rules and the metrics model. No processes, sockets or torch here.
"""
