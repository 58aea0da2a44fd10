"""RL algorithms: the policy-gradient loss and GRPO advantages."""
