"""The learning-rate schedule (`policy.scheduler`): linear warmup, then constant or cosine.

A torch `LambdaLR` stepped once per optimizer step, so a checkpoint saves and restores it like any
other torch scheduler (`state_dict` / `load_state_dict`): its step count and base rates. The schedule
itself is never taken from a checkpoint: it is the run's config, so a run resumed with another
grpo.max_num_steps decays over the new total (LambdaLR's own state dict would bring back the old one,
and an extended cosine run would train at its final rate, 0 by default, from the resumed step on).
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


class ConfigSchedule(torch.optim.lr_scheduler.LambdaLR):
    """LambdaLR whose saved state is its progress (step count, base rates), never the schedule's settings."""

    def state_dict(self) -> dict:
        state = super().state_dict()
        state.pop("lr_lambdas", None)
        return state

    def load_state_dict(self, state_dict: dict) -> None:
        # a checkpoint saved before this class carries the old run's settings under lr_lambdas: not taken
        self.__dict__.update({k: v for k, v in state_dict.items() if k != "lr_lambdas"})
        # the rate of the next optimizer step, by this run's schedule (the optimizer's state, loaded before
        # this one: DCP loads Statefuls in key order, "policy" before "scheduler", holds the saving run's)
        rates = [base * fn(self.last_epoch) for base, fn in zip(self.base_lrs, self.lr_lambdas)]
        for group, rate in zip(self.optimizer.param_groups, rates):
            group["lr"] = rate
        self._last_lr = rates


def build_scheduler(optimizer: torch.optim.Optimizer, cfg) -> torch.optim.lr_scheduler.LambdaLR:
    """The configured schedule on `optimizer` (`cfg` is the whole run Config)."""
    s = cfg.policy.scheduler
    return ConfigSchedule(optimizer, WarmupSchedule(s.name, s.warmup_steps, optimizer_steps_per_run(cfg), s.min_lr_ratio))
