"""The driver process: the GRPO loop, the Fleet of processes and the step, rollout scheduling, the data-plane switch, placement, validation."""
