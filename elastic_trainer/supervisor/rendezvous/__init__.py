"""How the supervisor meets the other nodes: torch's c10d rendezvous handler with our knobs,
the store endpoint, presence (peers' closed connections) and static mode. Runs in the
supervisor process.
"""
