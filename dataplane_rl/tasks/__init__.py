"""Tasks: prompts and pure reward functions. `get_task(name).reward(prompt, response) -> float`.

A task makes the prompts of a step deterministically from (seed, step, round) and scores a response.
Rewards are pure functions of (prompt, response), so any row of a run folder can be re-scored.
"""

from __future__ import annotations

import json
import random
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Protocol

from dataplane_rl.errors import ConfigError


class Task(Protocol):
    name: str

    def prompts(self, seed: int, step: int, round_: int, n: int) -> list[str]:
        """The n prompts of (step, round), the same for every run with this seed."""

    def reward(self, prompt: str, response: str) -> float:
        """Score of `response` to `prompt`; pure."""


@dataclass
class DigitTask:
    """The prompt is one digit; the response's first `length` characters are scored against a target
    string made from it. The reward is the fraction that are right: dense, in [0, 1]."""

    length: int = 6
    name: str = "digits"

    def prompts(self, seed: int, step: int, round_: int, n: int) -> list[str]:
        rng = random.Random(f"{self.name}/{seed}/{step}/{round_}")
        return [str(rng.randrange(10)) for _ in range(n)]

    def target(self, prompt: str) -> str:
        raise NotImplementedError

    def reward(self, prompt: str, response: str) -> float:
        target = self.target(prompt)
        return sum(a == b for a, b in zip(response, target)) / self.length


@dataclass
class RepeatTask(DigitTask):
    """Repeat the prompt's digit: '7' -> '777777'. The default: the tiny model's mean reward climbs from
    ~0.03 to ~0.4 within the default 30 steps on 2 CPU cores."""

    name: str = "repeat"

    def target(self, prompt: str) -> str:
        return prompt.strip()[-1] * self.length


@dataclass
class CountTask(DigitTask):
    """Count up from the prompt's digit: '7' -> '890123' (mod 10). Harder than repeat: the tiny model
    tends to lock onto one digit after the first, so it needs more steps."""

    name: str = "count"

    def target(self, prompt: str) -> str:
        d = int(prompt.strip()[-1])
        return "".join(str((d + i + 1) % 10) for i in range(self.length))


@dataclass
class MathJsonlTask:
    """Questions from a JSONL file ({"question": ..., "answer": ...} per line), exact-match verifier.

    The reward is 1.0 when the response, stripped, equals the answer, or when its last line/number
    after 'answer:' does; else 0.0.
    """

    path: str
    name: str = "math_jsonl"
    items: list[tuple[str, str]] = field(default_factory=list)
    answers: dict[str, str] = field(default_factory=dict)

    def __post_init__(self) -> None:
        p = Path(self.path)
        if not p.is_file():
            raise ConfigError(f"task.path '{p}' not found; math_jsonl needs a JSONL file with question and answer fields")
        try:
            text = p.read_bytes().decode()
        except UnicodeDecodeError as e:
            raise ConfigError(f"task.path '{p}' is not UTF-8 text ({e.reason} at byte {e.start}); math_jsonl needs a "
                              "JSONL file with question and answer fields") from None
        except OSError as e:
            raise ConfigError(f"task.path '{p}' cannot be read ({e.strerror}); math_jsonl needs a readable UTF-8 "
                              "JSONL file") from None
        for i, line in enumerate(text.splitlines(), 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
                q, a = str(row["question"]), str(row["answer"]).strip()
            except (json.JSONDecodeError, KeyError, TypeError) as e:
                raise ConfigError(f"task.path '{p}' line {i}: need a JSON object with 'question' and 'answer' ({e})") from None
            self.items.append((q, a))
            self.answers[self.format(q)] = a
        if not self.items:
            raise ConfigError(f"task.path '{p}' holds no questions")

    @staticmethod
    def format(question: str) -> str:
        return f"Q: {question}\nA: "

    def prompts(self, seed: int, step: int, round_: int, n: int) -> list[str]:
        rng = random.Random(f"math/{seed}/{step}/{round_}")
        return [self.format(rng.choice(self.items)[0]) for _ in range(n)]

    def reward(self, prompt: str, response: str) -> float:
        try:
            answer = self.answers[prompt]
        except KeyError:
            raise ConfigError(f"math_jsonl: prompt {prompt[:40]!r} is not a question of {self.path}") from None
        text = response.strip()
        m = re.search(r"answer:\s*(.+)$", text, flags=re.IGNORECASE)
        candidate = m.group(1).strip() if m else text
        return 1.0 if candidate == answer else 0.0


TASKS: dict[str, Callable[..., Task]] = {
    "repeat": lambda path=None: RepeatTask(),
    "count": lambda path=None: CountTask(),
    "math_jsonl": lambda path=None: MathJsonlTask(path or str(Path(__file__).parent / "math_sample.jsonl")),
}


def get_task(name: str, path: str | None = None) -> Task:
    """The registered task `name` (path: its data file, for file-based tasks)."""
    try:
        factory = TASKS[name]
    except KeyError:
        raise ConfigError(f"unknown task.name '{name}'; registered tasks: {', '.join(TASKS)}") from None
    return factory(path)


def register_task(name: str, factory: Callable[..., Task]) -> None:
    """Add a task: `factory(path)` returns an object with prompts() and reward()."""
    TASKS[name] = factory
