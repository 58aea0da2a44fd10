"""The train worker: one torch.distributed rank, its batch and microbatches, packing, global counts, FSDP2 and state."""
