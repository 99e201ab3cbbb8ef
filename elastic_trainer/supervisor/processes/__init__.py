"""The supervisor's worker processes: start them with their environment, relay their output,
watch them, signal and kill their trees, and the node-level sentinel (its own process).
"""
