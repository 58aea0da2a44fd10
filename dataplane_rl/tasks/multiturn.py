"""Multi-turn tasks: an environment the policy talks to for several turns, as a pure function of the trajectory.

A multi-turn task has `multi_turn = True` and, besides `prompts()` and `val_prompts()`,
`step(prompt, actions) -> EnvStep`: given the prompt and the policy's actions so far (the decoded text of each
turn's sampled tokens), the observation to append, whether the episode is over, and the reward if it ended now.
It reads nothing but its arguments, so any stored row can be re-scored from its prompt and its actions
(`actions_of_row` recovers them from the row's tokens); `reward(prompt, actions)` is the last step's reward.

The hidden state of an episode (the secret number, the tool's key) is derived from the prompt by a hash, so
the prompt names the episode and the policy cannot read the secret from it.
"""

from __future__ import annotations

import hashlib
import random
from collections.abc import Sequence
from dataclasses import dataclass
from typing import ClassVar, Protocol

from dataplane_rl.tasks.pools import split_held_out


@dataclass(frozen=True)
class EnvStep:
    """The environment's answer to the policy's latest action."""

    observation: str  # text appended after the action (tokenized on its own); may be "" only when done
    done: bool        # the episode is over
    reward: float     # the episode's reward if it ends here (used at the end: done, max turns or length limit)


class MultiTurnTask(Protocol):
    name: str
    multi_turn: bool

    def prompts(self, seed: int, step: int, round_: int, n: int) -> list[str]: ...

    def val_prompts(self, n: int) -> list[str]: ...

    def step(self, prompt: str, actions: Sequence[str]) -> EnvStep: ...

    def reward(self, prompt: str, actions: Sequence[str]) -> float: ...


def is_multi_turn(task) -> bool:
    return bool(getattr(task, "multi_turn", False))


def _secret(prompt: str, n: int) -> int:
    """1..n from the prompt text (blake2b: Python's hash() is salted per process)."""
    return int.from_bytes(hashlib.blake2b(prompt.encode(), digest_size=8).digest(), "little") % n + 1


@dataclass
class _Episodes:
    """Prompts `{name} NNNN:`; a fifth of the ids held out for validation."""

    name: str = ""
    ids: int = 10_000
    multi_turn: ClassVar[bool] = True

    def __post_init__(self) -> None:
        self.train_pool, self.val_pool = split_held_out([f"{self.name} {i:04d}:" for i in range(self.ids)])

    def prompts(self, seed: int, step: int, round_: int, n: int) -> list[str]:
        rng = random.Random(f"{self.name}/{seed}/{step}/{round_}")
        return [rng.choice(self.train_pool) for _ in range(n)]

    def val_prompts(self, n: int) -> list[str]:
        return self.val_pool[:n]

    def reward(self, prompt: str, actions: Sequence[str]) -> float:
        return self.step(prompt, list(actions)).reward if actions else 0.0


@dataclass
class GuessTask(_Episodes):
    """Guess a secret in 1..`high` in at most `guesses` turns. The prompt names the game and the range
    (`guess NNNN 1-7:`); each guess is answered `higher`, `lower` or `correct`, with the range still possible
    (`higher, 5-7:`); a guess that is no number in range is `invalid` (a lost turn). Reward 1.0 on a hit.

    With high=7 and 3 guesses binary search (the middle of the range shown) always wins (7 = 2^3 - 1) and
    needs the feedback; a uniform guesser over 1..7 that never repeats wins 3/7. The range makes the best
    guess a function of the last observation alone: without it (feedback words only) the tiny model stayed at
    the random guesser's ~0.45 after 60 steps, twice (docs/multiturn.md). Its untrained one-token actions
    are near-uniform over its 53 tokens, so it starts near 0.06 and first learns to answer with digits."""

    name: str = "guess"
    high: int = 7
    guesses: int = 3

    def __post_init__(self) -> None:
        self.train_pool, self.val_pool = split_held_out([f"{self.name} {i:04d} 1-{self.high}:" for i in range(self.ids)])

    def step(self, prompt: str, actions: Sequence[str]) -> EnvStep:
        secret = _secret(prompt.split()[1], self.high)
        lo, hi = 1, self.high
        for i, action in enumerate(actions):
            text = action.strip()
            guess = int(text) if text.isdigit() and len(text) == 1 else None
            if guess == secret:
                return EnvStep("correct", True, 1.0)
            if i + 1 >= self.guesses:
                return EnvStep("", True, 0.0)
            if guess is None or not 1 <= guess <= self.high:
                word = "invalid"
            elif secret > guess:
                word, lo = "higher", max(lo, guess + 1)
            else:
                word, hi = "lower", min(hi, guess - 1)
        return EnvStep(f"{word}, {lo}-{hi}:", False, 0.0)


@dataclass
class ToolTask(_Episodes):
    """A tool lookup: the policy's first turn calls the tool (any text), the tool answers with a random key
    digit (`key=7:`), and the second turn must repeat it. Reward 1.0 when the second action starts with the
    key. Nothing but the observation carries the key, and the key is random per episode: a run that trained on
    the tool's tokens would show it at once (the key's log-probs would move; tests/test_multiturn.py)."""

    name: str = "tool"

    def step(self, prompt: str, actions: Sequence[str]) -> EnvStep:
        key = _secret(prompt, 10) - 1
        if len(actions) == 1:
            return EnvStep(f"key={key}:", False, 0.0)
        hit = actions[1].strip()[:1] == str(key)
        return EnvStep("", True, 1.0 if hit else 0.0)


def actions_of_row(tokenizer, input_ids, token_mask, turn_index) -> list[str]:
    """The decoded actions of a stored row (its sampled tokens, turn by turn): what `step`/`reward` take."""
    turns: dict[int, list[int]] = {}
    for t, m, k in zip(input_ids, token_mask, turn_index):
        if m:
            turns.setdefault(int(k), []).append(int(t))
    return [tokenizer.decode(turns[k], skip_special_tokens=True) for k in sorted(turns)]
