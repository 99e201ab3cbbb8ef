"""Writing snapshots: capture on the training thread, then a writer thread or process commits
the files and the manifest; retention's deletions.
"""
