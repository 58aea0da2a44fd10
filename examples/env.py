"""A multi-turn environment in a file of your own: task.module=examples/env.py task.name=countdown.

The module is imported in the driver and in every rollout actor and train worker, so its register_task call
happens in each of them. The prompt names a start (`countdown 7:`); each policy turn should say the next number
down, and the environment answers `ok, next:` or `no, N:` (N, the number it wanted). Three turns; the reward is
the fraction said right. Everything is a function of the prompt and the actions, so any stored row re-scores.
"""

import random

from dataplane_rl.tasks import register_task
from dataplane_rl.tasks.multiturn import EnvStep
from dataplane_rl.tasks.pools import split_held_out

TURNS = 3


class Countdown:
    name = "countdown"
    multi_turn = True

    def __init__(self):
        self.train_pool, self.val_pool = split_held_out([f"countdown {n}:" for n in range(TURNS, 100)])

    def prompts(self, seed, step, round_, n):
        rng = random.Random(f"countdown/{seed}/{step}/{round_}")
        return [rng.choice(self.train_pool) for _ in range(n)]

    def val_prompts(self, n):
        return self.val_pool[:n]

    def wanted(self, prompt):
        start = int(prompt.split()[1].rstrip(":"))
        return [str(start - k) for k in range(1, TURNS + 1)]

    def step(self, prompt, actions):
        want = self.wanted(prompt)
        right = sum(a.strip() == w for a, w in zip(actions, want))
        if len(actions) >= TURNS:
            return EnvStep("", True, right / TURNS)
        ok = actions[-1].strip() == want[len(actions) - 1]
        return EnvStep(" ok, next:" if ok else f" no, {want[len(actions) - 1]}:", False, right / TURNS)

    def reward(self, prompt, actions):
        return self.step(prompt, list(actions)).reward if actions else 0.0

    def row(self, prompt):
        """What a task.reward_function gets for this prompt (optional: without it, data_source is the name)."""
        from dataplane_rl.tasks.dataset import PromptRow

        return PromptRow("countdown", ground_truth=" ".join(self.wanted(prompt)), extra_info={"turns": TURNS})


register_task("countdown", lambda path=None: Countdown())
