"""The driver process: the GRPO loop and trainer, rollout scheduling, the data-plane switch, placement, validation."""
