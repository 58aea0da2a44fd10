"""docs/tasks.md's note on what the tiny model can learn, checked: on math_jsonl its samples score 0, so
almost every advantage is 0 (next to nothing to learn); on repeat, groups have differing rewards from the start.
If a change to a task or the model makes this false, update that note with it."""

from __future__ import annotations

import numpy as np

from dataplane_rl.algorithms.grpo import advantages
from dataplane_rl.config import load_config
from dataplane_rl.rollout.worker import RolloutJob, RolloutWorker
from dataplane_rl.tasks import get_task
from dataplane_rl.model.load import build_tiny


def step_one_rewards(task: str) -> tuple[np.ndarray, np.ndarray]:
    """Rewards and group ids of step 1 at the default shape (16 prompts x 8 samples), the tiny model."""
    path = [f"task.path={get_task('math_jsonl').path}"] if task == "math_jsonl" else []  # the bundled sample
    cfg = load_config(None, [f"task.name={task}", *path])
    worker = RolloutWorker(cfg.model_dump(mode="json", by_alias=True), str(build_tiny(cfg.grpo.seed)), None, 1)
    P, G = cfg.grpo.num_prompts_per_step, cfg.grpo.num_generations_per_prompt
    job = RolloutJob("step-000001", 1, 0, 0, list(range(P)), worker.task.prompts(cfg.grpo.seed, 1, 0, P))
    table, _ = worker.generate(job)
    return table.column("total_reward").to_numpy().astype(np.float64), table.column("group_id").to_numpy()


def test_tiny_model_almost_never_scores_on_math_jsonl():
    rewards, groups = step_one_rewards("math_jsonl")
    # the last-number rule lets a lucky digit score now and then: at most a couple of 16 groups differ
    assert rewards.size == 128 and rewards.mean() <= 0.05
    informative = [g for g in np.unique(groups) if np.ptp(rewards[groups == g]) > 0]
    assert len(informative) <= 2
    adv = advantages(rewards, groups)
    assert not adv[~np.isin(groups, informative)].any()


def test_tiny_model_gets_differing_rewards_on_repeat():
    rewards, groups = step_one_rewards("repeat")
    spread = [np.ptp(rewards[groups == g]) for g in np.unique(groups)]
    assert sum(s > 0 for s in spread) >= len(spread) // 2
