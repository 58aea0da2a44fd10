"""`task.name=dataset`: prompts from Parquet, JSONL or a saved `datasets` folder, in verl's layout, epochs in a seeded order.

A row gives the prompt (text, or chat messages rendered with the tokenizer's chat template), the ground truth
(`reward_model.ground_truth`), `data_source` and `extra_info`. The prompts of step k are positions
(k-1)*n .. k*n-1 of an endless sequence of epochs, each epoch the training prompts in an order seeded by
(grpo.seed, epoch): a pure function of (seed, step), so a resumed run draws exactly what it would have, with no
data cursor to save. Dynamic sampling's extra rounds (round > 0) draw seeded at random instead.
"""

from __future__ import annotations

import functools
import json
import random
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from dataplane_rl.errors import ConfigError
from dataplane_rl.tasks.answers import answer_reward, extract_answer
from dataplane_rl.tasks.pools import split_held_out

SUFFIXES = (".parquet", ".jsonl", ".json")


@dataclass(frozen=True)
class PromptRow:
    """What a prompt's row gives the reward function, besides the response."""

    data_source: str
    ground_truth: Any = None
    extra_info: Any = field(default_factory=dict)

    @property
    def extra_json(self) -> str:
        """extra_info as the store keeps it: JSON, keys sorted (default=str: dates and such become text)."""
        return json.dumps(self.extra_info if self.extra_info is not None else {}, sort_keys=True, default=str)


def read_rows(path: str) -> list[dict]:
    """The rows of a Parquet or JSONL file, a folder of them (files in name order), or a `datasets` folder."""
    p = Path(path)
    if p.is_dir():
        if (p / "dataset_info.json").is_file() or (p / "dataset_dict.json").is_file():
            return _saved_dataset(p)
        files = sorted(f for f in p.iterdir() if f.suffix in SUFFIXES and f.is_file())
        if not files:
            raise ConfigError(f"task path '{p}' is a folder with no .parquet or .jsonl files")
        return [row for f in files for row in read_rows(str(f))]
    if not p.is_file():
        raise ConfigError(f"task path '{p}' not found; give a Parquet or JSONL file, or a folder of them")
    if p.suffix == ".parquet":
        import pyarrow.parquet as pq

        try:
            return pq.read_table(p).to_pylist()
        except Exception as e:  # noqa: BLE001 - pyarrow's errors for a bad file are of several kinds
            raise ConfigError(f"task path '{p}' is not a readable Parquet file: {type(e).__name__}: {e}") from None
    if p.suffix in (".jsonl", ".json"):
        return _jsonl(p)
    raise ConfigError(f"task path '{p}': unknown file type '{p.suffix}'; use .parquet or .jsonl")


def _jsonl(p: Path) -> list[dict]:
    try:
        text = p.read_bytes().decode()
    except UnicodeDecodeError as e:
        raise ConfigError(f"task path '{p}' is not UTF-8 text ({e.reason} at byte {e.start})") from None
    rows = []
    for i, line in enumerate(text.splitlines(), 1):
        if line.strip():
            try:
                row = json.loads(line)
            except json.JSONDecodeError as e:
                raise ConfigError(f"task path '{p}' line {i}: not JSON ({e.msg}); one JSON object per line") from None
            if not isinstance(row, dict):
                raise ConfigError(f"task path '{p}' line {i}: a JSON {type(row).__name__}, not an object")
            rows.append(row)
    return rows


def _saved_dataset(p: Path) -> list[dict]:
    try:
        import datasets
    except ImportError:
        raise ConfigError(f"task path '{p}' is a Hugging Face datasets folder; reading it needs the datasets "
                          "package: pip install datasets (or save it as Parquet: ds.to_parquet('train.parquet'))") from None
    ds = datasets.load_from_disk(str(p))
    if isinstance(ds, datasets.DatasetDict):
        raise ConfigError(f"task path '{p}' holds the splits {sorted(ds)}; point task.path at one split's folder, "
                          f"e.g. {p / 'train'}")
    return ds.to_list()


def pick(row: dict, key: str):
    """row[key], with a dotted key reaching into nested dicts: 'reward_model.ground_truth'."""
    if key in row:
        return row[key]
    value = row
    for part in key.split("."):
        if not isinstance(value, dict) or part not in value:
            raise KeyError(key)
        value = value[part]
    return value


def render_prompt(prompt, tokenizer, where: str) -> str:
    """A prompt as the engine's text: text as it is; chat messages through the tokenizer's chat template."""
    if isinstance(prompt, str):
        if not prompt.strip():
            raise ConfigError(f"{where}: the prompt is empty")
        return prompt
    ok = isinstance(prompt, (list, tuple)) and prompt and all(isinstance(m, dict) and "role" in m and "content" in m
                                                              for m in prompt)
    if not ok:
        raise ConfigError(f"{where}: the prompt is {json.dumps(prompt, default=str)[:60]}; it must be text or chat "
                          "messages, a list of {role, content}")
    if tokenizer is None:
        raise ConfigError(f"{where}: the prompt is chat messages, and rendering them needs the model's tokenizer "
                          "(load the task with load_task(cfg.task, tokenizer))")
    if not getattr(tokenizer, "chat_template", None):
        raise ConfigError(f"{where}: the prompt is chat messages but policy.model's tokenizer has no chat template; "
                          "use a model whose tokenizer_config.json has a chat_template, or give prompts as text")
    messages = [{"role": m["role"], "content": m["content"]} for m in prompt]  # Parquet structs may add null keys
    return tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)


class DatasetTask:
    """Prompts and ground truths from a dataset file; the default reward compares the response's final answer
    with the ground truth (as math_jsonl does); task.reward_function replaces it."""

    name = "dataset"

    def __init__(self, path: str, val_path: str | None = None, input_key: str = "prompt",
                 output_key: str = "reward_model.ground_truth", shuffle: bool = True, tokenizer=None) -> None:
        self.path, self.shuffle = path, shuffle
        self.rows: dict[str, PromptRow] = {}
        self.first: dict[str, str] = {}  # prompt -> where it first appeared, for the duplicate's error
        self.source = Path(path).stem
        train = self._load(path, input_key, output_key, tokenizer)
        if val_path:
            self.train_pool, self.val_pool = train, self._load(val_path, input_key, output_key, tokenizer)
        else:
            held = set(split_held_out(train)[1])
            self.train_pool = [p for p in train if p not in held]
            self.val_pool = [p for p in train if p in held]
        if not self.train_pool:
            raise ConfigError(f"task.path '{path}' leaves no training prompts")

    def _load(self, path: str, input_key: str, output_key: str, tokenizer) -> list[str]:
        """The distinct rendered prompts of `path` in file order; fills self.rows."""
        rows = read_rows(path)
        if not rows:
            raise ConfigError(f"task path '{path}' holds no rows")
        order, seen = [], set()
        for i, row in enumerate(rows):
            where = f"task path '{path}' row {i}"
            for key in (input_key, output_key):
                try:
                    pick(row, key)
                except KeyError:
                    which = "task.input_key" if key == input_key else "task.output_key"
                    raise ConfigError(f"{where} has no '{key}' ({which}); its columns: {', '.join(map(str, row))}; "
                                      f"set {which} to the column that holds it") from None
            text = render_prompt(pick(row, input_key), tokenizer, where)
            source = row.get("data_source")
            data = PromptRow(str(source) if source is not None else self.source, pick(row, output_key),
                             row.get("extra_info") or {})
            if text in self.rows and self.rows[text] != data:
                raise ConfigError(f"{where} repeats the prompt of {self.first[text]} with another ground truth, "
                                  f"data_source or extra_info; a prompt names one row: drop or merge one of them")
            if text not in seen:
                seen.add(text)
                order.append(text)
            self.rows[text] = data
            self.first.setdefault(text, f"{path} row {i}")
        return order

    @functools.lru_cache(maxsize=4)
    def _order(self, seed: int, epoch: int) -> list[int]:
        order = list(range(len(self.train_pool)))
        if self.shuffle:
            random.Random(f"dataset/{seed}/epoch{epoch}").shuffle(order)
        return order

    def prompts(self, seed: int, step: int, round_: int, n: int) -> list[str]:
        if round_ > 0:  # dynamic sampling's extra rounds: a seeded draw that leaves the epochs' order alone
            rng = random.Random(f"dataset/{seed}/{step}/{round_}")
            return [rng.choice(self.train_pool) for _ in range(n)]
        N, start = len(self.train_pool), max(step - 1, 0) * n
        return [self.train_pool[self._order(seed, pos // N)[pos % N]] for pos in range(start, start + n)]

    def val_prompts(self, n: int) -> list[str]:
        return self.val_pool[:n]

    def row(self, prompt: str) -> PromptRow:
        try:
            return self.rows[prompt]
        except KeyError:
            raise ConfigError(f"dataset: prompt {prompt[:40]!r} is not a row of {self.path}") from None

    def reward(self, prompt: str, response: str) -> float:
        gold = extract_answer(str(self.row(prompt).ground_truth))
        return answer_reward(gold, response) if gold is not None else 0.0
