"""Tasks: prompts and pure reward functions. `get_task(name).reward(prompt, response) -> float`.

A task makes the prompts of a step deterministically from (seed, step, round) and scores a response.
Rewards are pure functions of (prompt, response), so any row of a run folder can be re-scored.
Every task splits its prompts into a training pool and a held-out validation pool, disjoint, by a hash
of the prompt text: `prompts()` draws only from the first, `val_prompts()` lists the second.
"""

from __future__ import annotations

import inspect
import json
import random
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Protocol

from dataplane_rl.errors import ConfigError
from dataplane_rl.tasks.answers import answer_reward, extract_answer
from dataplane_rl.tasks.dataset import DatasetTask, PromptRow
from dataplane_rl.tasks import multiturn
from dataplane_rl.tasks.pools import VAL_SHARE, split_held_out  # noqa: F401  (VAL_SHARE: part of the tasks API)


class Task(Protocol):
    name: str

    def prompts(self, seed: int, step: int, round_: int, n: int) -> list[str]:
        """The n prompts of (step, round), the same for every run with this seed; never a held-out one."""

    def val_prompts(self, n: int) -> list[str]:
        """Up to n held-out prompts, always the same ones in the same order."""

    def reward(self, prompt: str, response: str) -> float:
        """Score of `response` to `prompt`; pure."""


@dataclass
class DigitTask:
    """The prompt is `prompt_digits` digits; the response's first `length` characters are scored against
    a target made from its last digit. The reward is the fraction that are right: dense, in [0, 1]."""

    length: int = 6
    prompt_digits: int = 3
    name: str = "digits"

    def __post_init__(self) -> None:
        every = [str(i).zfill(self.prompt_digits) for i in range(10 ** self.prompt_digits)]
        self.train_pool, self.val_pool = split_held_out(every)

    def prompts(self, seed: int, step: int, round_: int, n: int) -> list[str]:
        rng = random.Random(f"{self.name}/{seed}/{step}/{round_}")
        return [rng.choice(self.train_pool) for _ in range(n)]

    def val_prompts(self, n: int) -> list[str]:
        return self.val_pool[:n]

    def target(self, prompt: str) -> str:
        raise NotImplementedError

    def reward(self, prompt: str, response: str) -> float:
        target = self.target(prompt)
        return sum(a == b for a, b in zip(response, target)) / self.length


@dataclass
class RepeatTask(DigitTask):
    """Repeat the prompt's last digit: '407' -> '777777'. The default task: the tiny model's sampled
    reward climbs from ~0.04 to ~0.95 in ~100 steps. Its greedy decoding copies its last token even
    untrained (held-out reward ~0.9 at step 0); training first breaks that, then relearns it."""

    name: str = "repeat"

    def target(self, prompt: str) -> str:
        return prompt.strip()[-1] * self.length


@dataclass
class NextTask(DigitTask):
    """The digit after the prompt's last digit, repeated: '407' -> '888888' (9 -> 0).

    Unlike `repeat`, an untrained model does not solve it by chance (its greedy output tends to copy
    the last input token, ~0.9 on `repeat`, ~0 here), and it is harder to learn: the same input digit
    must map to its successor at the prompt's end but to itself inside the response."""

    name: str = "next"

    def target(self, prompt: str) -> str:
        return str((int(prompt.strip()[-1]) + 1) % 10) * self.length


@dataclass
class CountTask(DigitTask):
    """Count up from the prompt's last digit: '407' -> '890123' (mod 10). Harder than repeat: the tiny
    model tends to lock onto one digit after the first, so it needs more steps."""

    name: str = "count"

    def target(self, prompt: str) -> str:
        d = int(prompt.strip()[-1])
        return "".join(str((d + i + 1) % 10) for i in range(self.length))


@dataclass
class MathJsonlTask:
    """GSM8K-style questions from a JSONL file ({"question": ..., "answer": ...} per line).

    The reference answer may be a GSM8K solution ending in `#### 42`; its final number is the answer.
    The reward is 1.0 when the number extracted from the response (`#### 42`, else `answer: 42`, else
    the last number; see `dataplane_rl.tasks.answers`) equals it after normalisation (`42.0`, `1,000`),
    or, for a non-numeric answer, when the extracted text equals it; else 0.0.
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
                q, a = row["question"], row["answer"]
            except (json.JSONDecodeError, KeyError, TypeError) as e:
                raise ConfigError(f"task.path '{p}' line {i}: need a JSON object with 'question' and 'answer' ({e})") from None
            # str() would make a null question the text "None"
            if not isinstance(q, str) or not q.strip():
                raise ConfigError(f"task.path '{p}' line {i}: 'question' is {json.dumps(q)}; it must be non-empty text")
            if isinstance(a, bool) or not isinstance(a, (str, int, float)):
                raise ConfigError(f"task.path '{p}' line {i}: 'answer' is {json.dumps(a)}; it must be text or a number")
            a = str(a).strip()
            gold = extract_answer(a)
            if gold is None:
                raise ConfigError(f"task.path '{p}' line {i}: answer {a[:40]!r} is empty")
            self.items.append((q, gold))
            self.answers[self.format(q)] = gold
        if not self.items:
            raise ConfigError(f"task.path '{p}' holds no questions")
        self.train_pool, self.val_pool = split_held_out([self.format(q) for q, _ in self.items])

    @staticmethod
    def format(question: str) -> str:
        return f"Q: {question}\nA: "

    def prompts(self, seed: int, step: int, round_: int, n: int) -> list[str]:
        rng = random.Random(f"math/{seed}/{step}/{round_}")
        return [rng.choice(self.train_pool) for _ in range(n)]

    def val_prompts(self, n: int) -> list[str]:
        return self.val_pool[:n]

    def reward(self, prompt: str, response: str) -> float:
        try:
            answer = self.answers[prompt]
        except KeyError:
            raise ConfigError(f"math_jsonl: prompt {prompt[:40]!r} is not a question of {self.path}") from None
        return answer_reward(answer, response)


TASKS: dict[str, Callable[..., Task]] = {
    "next": lambda path=None: NextTask(),
    "repeat": lambda path=None: RepeatTask(),
    "count": lambda path=None: CountTask(),
    "math_jsonl": lambda path=None: MathJsonlTask(path or str(Path(__file__).parent / "math_sample.jsonl")),
    # multi-turn (tasks/multiturn.py)
    # text prompts (load_task passes the keys and the tokenizer); no path: the bundled math sample, as math_jsonl
    "dataset": lambda path=None: DatasetTask(path) if path else DatasetTask(
        str(Path(__file__).parent / "math_sample.jsonl"), input_key="question", output_key="answer"),
    "guess": lambda path=None: multiturn.GuessTask(),
    "tool": lambda path=None: multiturn.ToolTask(),
}


def get_task(name: str, path: str | None = None, tokenizer=None, val_path: str | None = None) -> Task:
    """The registered task `name` (path: its data file, for file-based tasks). A factory with a `tokenizer`
    parameter gets the model's tokenizer (to render chat prompts, as DatasetTask does), one with a `val_path`
    parameter task.val_path; task.val_path for a factory without one is refused (it would be ignored)."""
    try:
        factory = TASKS[name]
    except KeyError:
        hint = "" if name in _BUILT_IN else "; a task of your own needs task.module=FILE.py, the file that registers it"
        raise ConfigError(f"unknown task.name '{name}'; registered tasks: {', '.join(TASKS)}{hint}") from None
    params = inspect.signature(factory).parameters
    kwargs = {"tokenizer": tokenizer} if tokenizer is not None and "tokenizer" in params else {}
    if val_path is not None:
        if "val_path" not in params:
            raise ConfigError(f"task.val_path is set, and task '{name}' takes no val_path (its factory has no val_path "
                              "parameter): it holds out its own prompts; drop task.val_path, or give the factory a "
                              "val_path parameter (register_task)")
        kwargs["val_path"] = val_path
    return factory(path, **kwargs)


_BUILT_IN = frozenset(TASKS)


def register_task(name: str, factory: Callable[..., Task]) -> None:
    """Add a task: `factory(path)` returns an object with prompts(), val_prompts() and reward() (a multi-turn
    environment: step() too, and `multi_turn = True`), and may have row(key) -> PromptRow (data_source, ground
    truth, extra_info for task.reward_function). prompts() returns prompt texts, or keys of the task's own (a
    dataset's row ids) that its text(key) renders. `factory(path, tokenizer=None, val_path=None)` also gets the
    model's tokenizer and task.val_path. From the CLI: in a file named by task.module, imported in every process
    of the run."""
    TASKS[name] = factory


def prompt_text(task, key) -> str:
    """The text of prompt `key`: a task with rows (DatasetTask) renders its row; else the key is the text."""
    text = getattr(task, "text", None)
    if callable(text):
        return text(key)
    if not isinstance(key, str) or not key.strip():
        raise ConfigError(f"{task_label(task)}: prompts() gave {key!r} ({type(key).__name__}); a prompt is non-empty "
                          "text, or the task defines text(key) to render its keys")
    return key


def prompt_row(task, key) -> PromptRow:
    """The row a prompt comes from (data_source, ground_truth, extra_info): the task's own `row(key)`, else
    data_source = the task's name, no ground truth, extra_info {}."""
    row = getattr(task, "row", None)
    return row(key) if callable(row) else PromptRow(str(getattr(task, "name", type(task).__name__)))


def row_columns(task, keys: list, G: int) -> dict:
    """The data_source, extra_info (JSON), ground_truth (text) and dataset_row columns of G samples per prompt, from
    each prompt's row; dataset_row is the row id of a task with rows, else -1."""
    import pyarrow as pa

    rows = [prompt_row(task, k) for k in keys]
    ids = [int(k) if isinstance(k, int) and not isinstance(k, bool) else -1 for k in keys]
    return {"data_source": pa.array([r.data_source for r in rows for _ in range(G)], type=pa.string()),
            "extra_info": pa.array([r.extra_json for r in rows for _ in range(G)], type=pa.string()),
            "ground_truth": pa.array([r.ground_truth_text for r in rows for _ in range(G)], type=pa.string()),
            "dataset_row": pa.array([i for i in ids for _ in range(G)], type=pa.int64())}


def task_label(task) -> str:
    """How an error names a task: its name, and task.module's file where the task came from one."""
    name = getattr(task, "name", type(task).__name__)
    module = type(getattr(task, "task", task)).__module__
    return f"task '{name}'" + (f" (task.module {sys.modules[module].__file__})" if module.startswith("dataplane_rl_user_")
                               and module in sys.modules else "")


def score(task, key, response) -> tuple[float, dict]:
    """(reward, reward_extra_info) of one response: task.reward_function's when set (ScoredTask.score), else the
    task's reward(), which must be a finite number (RewardFunctionError naming the task and the value)."""
    if isinstance(task, ScoredTask):
        return task.score(key, response)
    from dataplane_rl.errors import RewardFunctionError
    from dataplane_rl.tasks.user_code import finite_number

    def fail(what: str) -> RewardFunctionError:
        return RewardFunctionError(f"{task_label(task)} reward() {what} for prompt {str(key)[:40]!r} (response "
                                   f"{response[:40]!r}); a reward must be a finite number")
    return finite_number(task.reward(key, response), fail), {}


class ScoredTask:
    """A task whose reward is task.reward_function's, called with the prompt's row; everything else is the task's.
    A multi-turn task's episodes are scored once, at their end, on the episode's response text."""

    def __init__(self, task, user_reward) -> None:
        self.task, self.user_reward = task, user_reward

    def __getattr__(self, name: str):
        if name == "task":  # not yet set (copy, pickle): no recursion
            raise AttributeError(name)
        return getattr(self.task, name)

    @property
    def batched(self) -> bool:
        return self.user_reward.batched

    def reward(self, key, response: str) -> float:
        return self.score(key, response)[0]

    def score(self, key, response: str) -> tuple[float, dict]:
        from dataplane_rl.errors import RewardFunctionError

        r = prompt_row(self.task, key)
        try:
            return self.user_reward.score(r.data_source, response, r.ground_truth, r.extra_info)
        except RewardFunctionError as e:
            where = getattr(self.task, "where", None)  # a dataset names the row the failing call scored
            raise RewardFunctionError(f"{e} [{where(key)}]") if callable(where) else e from None

    def score_batch(self, keys: list, responses: list[str]) -> list:
        """task.reward_manager=batch: one call for every sample; per sample (reward, extras) or its error."""
        rows = [prompt_row(self.task, k) for k in keys]
        return self.user_reward.score_batch([r.data_source for r in rows], responses, [r.ground_truth for r in rows],
                                            [r.extra_info for r in rows])


def load_modules(task_cfg) -> None:
    """Import task.module in this process (once): every process of a run calls this before it looks up a task."""
    if task_cfg.module:
        from dataplane_rl.tasks.user_code import import_user_module

        import_user_module(task_cfg.module)


def load_task(task_cfg, tokenizer=None, draws: bool = True) -> Task:
    """The task of a run's `task.*` config: task.module imported first, dataset prompts rendered with `tokenizer`
    (needed for chat messages), the reward replaced by task.reward_function when it is set. draws=False: for a
    rollout actor, which renders and scores the rows it is sent and draws none (a dataset is not scanned)."""
    load_modules(task_cfg)
    c = task_cfg
    if c.name == "dataset":
        task = DatasetTask(c.path, c.val_path, c.input_key, c.output_key, c.shuffle, tokenizer, draws)
    else:
        task = get_task(c.name, c.path, tokenizer, c.val_path)
    if c.reward_function:
        from dataplane_rl.tasks.user_code import UserReward

        task = ScoredTask(task, UserReward(c.reward_function, c.reward_kwargs, c.reward_manager))
    return task
