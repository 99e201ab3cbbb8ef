"""The contract between the supervisor, its workers and the people who watch them:
run settings, control files and exit codes, and the event catalogue.
"""
