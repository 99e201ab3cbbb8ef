"""DTensor (FSDP2) state: state trees the supported way and tensors to shard files, with
torch.distributed.checkpoint's planners doing the geometry.
"""
