"""Pure: what a snapshot is on storage (layout, manifest, shard table) and the bytes of its
tensors and RNG state.
"""
