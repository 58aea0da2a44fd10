"""dataplane-rl: a columnar data plane for RL post-training, with a GRPO pipeline on top."""

__version__ = "0.1.0"
