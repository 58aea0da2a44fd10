"""Training: the data-parallel group, global loss counts and the microbatch loop."""
