"""The learning-rate schedule (`policy.scheduler`): linear warmup, then constant or cosine.

A torch `LambdaLR` stepped once per optimizer step, so a checkpoint saves and restores it like any
other torch scheduler (`state_dict` / `load_state_dict`). The multiplier is a picklable object, not
a closure, so its settings travel in that state dict too.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch


@dataclass
class WarmupSchedule:
    """lr multiplier at optimizer step `s` (0-based) of `total_steps`."""

    name: str
    warmup_steps: int
    total_steps: int
    min_lr_ratio: float = 0.0

    def __call__(self, s: int) -> float:
        if s < self.warmup_steps:
            # (s + 1) / (W + 1), not s / W: the first step must not have lr 0, or it is a wasted step
            return (s + 1) / (self.warmup_steps + 1)
        if self.name == "constant":
            return 1.0
        decay_steps = max(1, self.total_steps - self.warmup_steps - 1)
        progress = min(1.0, (s - self.warmup_steps) / decay_steps)  # 0 after warmup, 1 at the last step
        return self.min_lr_ratio + (1.0 - self.min_lr_ratio) * 0.5 * (1.0 + math.cos(math.pi * progress))


def optimizer_steps_per_run(cfg) -> int:
    """Optimizer steps the whole run takes: rollout steps x global batches per step x epochs."""
    g, p = cfg.grpo, cfg.policy
    per_step = g.num_prompts_per_step * g.num_generations_per_prompt // p.train_global_batch_size
    return g.max_num_steps * per_step * g.num_epochs


def build_scheduler(optimizer: torch.optim.Optimizer, cfg) -> torch.optim.lr_scheduler.LambdaLR:
    """The configured schedule on `optimizer` (`cfg` is the whole run Config)."""
    s = cfg.policy.scheduler
    return torch.optim.lr_scheduler.LambdaLR(
        optimizer, WarmupSchedule(s.name, s.warmup_steps, optimizer_steps_per_run(cfg), s.min_lr_ratio))
