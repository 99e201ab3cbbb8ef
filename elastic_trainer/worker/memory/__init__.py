"""The in-memory snapshot tier: the latest state copy of every node, in node-local memory.

- ``tier``: replicated state (DDP), one copy per node split among its ranks; ``slots`` keeps
  it in two mapped slot files, ``byte_layout`` is its byte layout, ``plan`` the pure
  decisions (who copies what, when a copy is whole, where a restart restores from).
- ``shards``: sharded (FSDP2) state, each rank's own shards; ``rank_slots`` keeps them,
  ``mirror`` copies them to the next node and rebuilds a lost node's shards from there,
  ``shard_plan`` holds the pure decisions.
"""
