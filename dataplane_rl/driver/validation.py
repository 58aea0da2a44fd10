"""The validation phase: the policy on the task's held-out prompts, through the rollout engine and the
store like a training round, but nothing is trained (no advantages, no log-probs, no optimizer step).

One sample per prompt at `generation.val_temperature` (0 = greedy), in partitions `val-STEP-CHUNK` of
`grpo.val_batch_size` rows that are dropped as soon as their rewards are read.
"""

from __future__ import annotations

import time

import numpy as np

from dataplane_rl import trace
from dataplane_rl.errors import ConfigError
from dataplane_rl.driver.samples import source_rewards
from dataplane_rl.store import to_numpy


def check_task(grpo_cfg, task) -> None:
    """Before the start: validation needs the task's held-out prompts (a registered task may lack them)."""
    if (grpo_cfg.val_period > 0 or grpo_cfg.val_at_start) and not callable(getattr(task, "val_prompts", None)):
        raise ConfigError(f"task '{getattr(task, 'name', task)}' has no val_prompts(n) to validate on; add one "
                          "(held-out prompts, disjoint from prompts()) or set grpo.val_period=0 grpo.val_at_start=false")


def due(grpo_cfg, step: int) -> bool:
    """Validate after this training step: every `val_period` steps, and after the last one."""
    p = grpo_cfg.val_period
    return p > 0 and (step % p == 0 or step == grpo_cfg.max_num_steps)


@trace.traced("validation")
def validate(fleet, step: int) -> dict:
    """validation/reward (mean), validation/reward/<data_source> (verl's val-core), validation/accuracy (share of
    reward 1.0), validation/num_samples and timing/validation of the current policy; `fleet` is a started
    Fleet (driver/fleet.py)."""
    g = fleet.cfg.grpo
    t0 = time.perf_counter()
    prompts = fleet.sampler.val(g.max_val_samples)
    rewards, sources = [], []
    for start in range(0, len(prompts), g.val_batch_size):
        chunk = prompts[start:start + g.val_batch_size]
        pid = f"val-{step:06d}-{start // g.val_batch_size}"
        # group ids are the prompts' global indices: distinct sample seeds when val_temperature > 0
        receipts = fleet.rollout_round(pid, step, 0, chunk, G=1, group_offset=start, validation=True)
        # a prompt whose reward failed on every try has no row (rollout/retries.py): scored on the others
        failed = [r for receipt in receipts for r in receipt.get("failed_rows", ())]
        try:
            table = fleet.store.get(pid, ["total_reward", "data_source"],
                                      np.setdiff1d(np.arange(len(chunk)), failed) if failed else None)
            rewards.append(to_numpy(table.column("total_reward")).astype(np.float64))
            sources += table.column("data_source").to_pylist()
        finally:
            fleet.store.drop_partition(pid)
    r = np.concatenate(rewards) if rewards else np.zeros(0)
    per_source = {k.replace("train/reward/", "validation/reward/", 1): v for k, v in source_rewards(r, sources).items()}
    return {
        **per_source,
        "validation/reward": float(r.mean()) if r.size else 0.0,
        "validation/accuracy": float((r >= 1.0).mean()) if r.size else 0.0,
        "validation/num_samples": int(r.size),
        "timing/validation": time.perf_counter() - t0,
    }
