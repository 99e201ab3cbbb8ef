"""The supervisor's command line: argv and torchrun's environment to a validated ``RunConfig``,
the node's allocation, and the entrypoint preflight.
"""
