"""`task.name=dataset`: prompts from Parquet, JSONL or a saved `datasets` folder, in verl's layout, epochs in a seeded order.

A dataset row is an identity, as a store row is: it is named by its position in the file (`dataset_row`), the
sampler hands out row ids, and every sample carries its row's prompt, ground truth (`reward_model.ground_truth`),
`data_source` and `extra_info`. Duplicate prompts (verl's DAPO-Math-17k repeats each prompt 100 times) and one
prompt with several ground truths are legal: a group is one row. The file is memory-mapped Arrow
(tasks/dataset_file.py); a process turns into Python objects only the rows it is sent, and chat prompts are
rendered with the tokenizer's template per row, when a row is drawn.

The rows of step k are positions (k-1)*n .. k*n-1 of an endless sequence of epochs, each epoch the training rows in
an order seeded by (grpo.seed, epoch): a pure function of (seed, step), so a resumed run draws exactly what it would
have, with no data cursor to save. Dynamic sampling's extra rounds (round > 0) draw seeded at random instead.
"""

from __future__ import annotations

import functools
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from dataplane_rl.errors import ConfigError
from dataplane_rl.tasks.answers import answer_reward, extract_answer
from dataplane_rl.tasks.dataset_file import json_columns, open_dataset, python_values
from dataplane_rl.tasks.pools import split_held_out
from dataplane_rl.tasks.values import to_json


@dataclass(frozen=True)
class PromptRow:
    """What a prompt's row gives the reward function, besides the response."""

    data_source: str
    ground_truth: Any = None
    extra_info: Any = field(default_factory=dict)

    @property
    def extra_json(self) -> str:
        """extra_info as the store keeps it: strict JSON, keys sorted (tasks/values.py: NaN as "NaN")."""
        return to_json(self.extra_info if self.extra_info is not None else {})

    @property
    def ground_truth_text(self) -> str:
        """The ground_truth column: text as it is, anything else as strict JSON."""
        gt = self.ground_truth
        return gt if isinstance(gt, str) else to_json(gt)


def read_rows(path: str) -> list[dict]:
    """The rows of a Parquet or JSONL file, a folder of them, or a `datasets` folder, as Python dicts: for tools and
    tests on small files (a run maps the file instead: DatasetTask)."""
    table = open_dataset(path)
    mixed = json_columns(table)
    return [{k: json.loads(v) if k in mixed and v is not None else v for k, v in r.items()}
            for r in python_values(table, f"task path '{path}'")]


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
    ok = isinstance(prompt, (list, tuple)) and prompt and all(
        isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str) for m in prompt)
    if not ok:
        raise ConfigError(f"{where}: the prompt is {json.dumps(prompt, default=str)[:60]}; it must be text or chat "
                          "messages, a list of {role, content} with text in both (only text content is supported, "
                          "not a list of parts)")
    if tokenizer is None:
        raise ConfigError(f"{where}: the prompt is chat messages, and rendering them needs the model's tokenizer "
                          "(load the task with load_task(cfg.task, tokenizer))")
    if not getattr(tokenizer, "chat_template", None):
        raise ConfigError(f"{where}: the prompt is chat messages but policy.model's tokenizer has no chat template; "
                          "use a model whose tokenizer_config.json has a chat_template, or give prompts as text")
    messages = [{"role": m["role"], "content": m["content"]} for m in prompt]  # Parquet structs may add null keys
    return tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)


class DatasetTask:
    """Rows of a dataset file; the default reward compares the response's final answer with the row's ground truth
    (as math_jsonl does); task.reward_function replaces it. Prompt keys are row ids: rows of task.path are 0..N-1,
    rows of task.val_path N, N+1, ... (their position there plus N)."""

    name = "dataset"

    def __init__(self, path: str, val_path: str | None = None, input_key: str = "prompt",
                 output_key: str = "reward_model.ground_truth", shuffle: bool = True, tokenizer=None,
                 draws: bool = True) -> None:
        """draws=False: a rollout actor's task, which only reads the rows it is sent: the prompt column is not
        scanned (the driver checked it) and no pools are made, so the actor touches no page of other rows."""
        self.path, self.val_path, self.shuffle, self.tokenizer = path, val_path, shuffle, tokenizer
        self.input_key, self.output_key = input_key, output_key
        self.source = Path(path).stem
        self.files = [_File(p, input_key, output_key, draws) for p in (path, val_path) if p]
        chat = any(pa.types.is_list(f.prompt.type) or pa.types.is_large_list(f.prompt.type) for f in self.files)
        if chat and tokenizer is not None and not getattr(tokenizer, "chat_template", None):
            raise ConfigError(f"task path '{path}': the prompts are chat messages but policy.model's tokenizer has no "
                              "chat template; use a model whose tokenizer_config.json has a chat_template, or give "
                              "prompts as text")
        N = self.files[0].rows
        if not draws:
            self.train_rows = self.val_rows = np.zeros(0, np.int64)
            return
        if val_path:
            self.train_rows, self.val_rows = np.arange(N), np.arange(N, N + self.files[1].rows)
        else:
            held = self.files[0].held_out()  # [N] bool: a prompt's every copy on one side
            self.train_rows, self.val_rows = np.flatnonzero(~held), np.flatnonzero(held)
        if not self.train_rows.size:
            raise ConfigError(f"task.path '{path}' leaves no training prompts")

    def _locate(self, key) -> tuple["_File", int]:
        if isinstance(key, (bool, np.bool_)) or not isinstance(key, (int, np.integer)):
            raise ConfigError(f"dataset: prompt key {key!r} is not a row id of {self.path}")
        N = self.files[0].rows
        if 0 <= key < N:
            return self.files[0], int(key)
        if len(self.files) > 1 and N <= key < N + self.files[1].rows:
            return self.files[1], int(key) - N
        raise ConfigError(f"dataset: row {key} is not a row of {self.path}" + (f" or {self.val_path}" if self.val_path else ""))

    def where(self, key: int) -> str:
        f, i = self._locate(key)
        return f"task path '{f.path}' row {i}"

    def text(self, key: int) -> str:
        """The row's prompt as the engine's text (chat messages through the tokenizer's template)."""
        f, i = self._locate(key)
        return render_prompt(f.value(i, self.input_key), self.tokenizer, f"task path '{f.path}' row {i}")

    def is_chat(self, key: int) -> bool:
        """Whether the row's prompt is chat messages (its text is then the template's rendering)."""
        f, i = self._locate(key)
        return not isinstance(f.value(i, self.input_key), str)

    def row(self, key: int) -> PromptRow:
        """The row's data_source, ground truth and extra_info: new objects on every call, so a reward function that
        changes its extra_info changes nobody else's."""
        f, i = self._locate(key)
        source = f.value(i, "data_source", None)
        return PromptRow(str(source) if source is not None else Path(f.path).stem, f.value(i, self.output_key, None),
                         f.value(i, "extra_info", None) or {})

    @functools.lru_cache(maxsize=4)
    def _order(self, seed: int, epoch: int) -> np.ndarray:
        N = len(self.train_rows)
        if not self.shuffle:
            return self.train_rows
        # numpy's PCG64 permutes 1.8M rows in ~30 ms; a Python list shuffle takes seconds
        return self.train_rows[np.random.default_rng([seed, epoch, 0x64617461]).permutation(N)]

    def prompts(self, seed: int, step: int, round_: int, n: int) -> list[int]:
        if round_ != 0:  # dynamic sampling's extra rounds: a seeded draw that leaves the epochs' order alone
            rng = np.random.default_rng([seed, step, round_, 0x64617461])
            return self.train_rows[rng.integers(0, len(self.train_rows), n)].tolist()
        N, start = len(self.train_rows), max(step - 1, 0) * n
        pos = np.arange(start, start + n)
        return [int(self._order(seed, int(p // N))[p % N]) for p in pos]

    def val_prompts(self, n: int) -> list[int]:
        return self.val_rows[:n].tolist()

    def reward(self, key: int, response: str) -> float:
        gold = extract_answer(str(self.row(key).ground_truth))
        return answer_reward(gold, response) if gold is not None else 0.0


class _NoTemplate:
    """A stand-in tokenizer for checking chat messages' shape without rendering them."""

    chat_template = "-"

    @staticmethod
    def apply_chat_template(*args, **kwargs) -> str:
        return ""


_NO_TEMPLATE = _NoTemplate()


class _File:
    """One dataset file, memory-mapped, its prompts and ground truths checked once, its rows read one at a time."""

    def __init__(self, path: str, input_key: str, output_key: str, check: bool = True) -> None:
        self.path, self.table, self.input_key = path, open_dataset(path), input_key
        self.rows = self.table.num_rows
        self.mixed = json_columns(self.table)
        if not self.rows:
            raise ConfigError(f"task path '{path}' holds no rows")
        for key, which in ((input_key, "task.input_key"), (output_key, "task.output_key")):
            if _column(self.table, key) is None and not self.in_json(key):  # a JSON column's keys: checked per row
                raise ConfigError(f"task path '{path}' has no '{key}' ({which}); its columns: "
                                  f"{', '.join(self.table.column_names)}; set {which} to the column that holds it")
        self.prompt = (self.table.column(self._root(input_key)) if self.in_json(input_key)
                       else _column(self.table, input_key))
        if not check:
            return
        if not self.in_json(input_key):
            check_prompts(self.prompt, f"task path '{path}'", input_key)
        else:  # a JSONL column of mixed types, kept as JSON text: each prompt checked as it will be rendered
            for i in range(self.rows):
                prompt = self.value(i, input_key, None)
                if not isinstance(prompt, str):
                    render_prompt(prompt, _NO_TEMPLATE, f"task path '{path}' row {i}")
        self.check_ground_truths(output_key)

    def _root(self, key: str) -> str:
        return key if key in self.table.column_names else key.split(".")[0]

    def in_json(self, key: str) -> bool:
        """Whether `key` lives in a column kept as JSON text (tasks/dataset_file.py)."""
        return self._root(key) in self.mixed

    def check_ground_truths(self, key: str) -> None:
        """Refuse a row whose ground truth is null or missing, naming the first: the reward would get None, and the
        default reward would score it as the text "None"."""
        if self.in_json(key):
            first = next((i for i in range(self.rows) if self.value(i, key, None) is None), None)
        else:
            nulls = np.flatnonzero(pc.is_null(_column(self.table, key)).to_numpy(zero_copy_only=False))
            first = int(nulls[0]) if nulls.size else None
        if first is not None:
            raise ConfigError(f"task path '{self.path}' row {first}: the ground truth ('{key}', task.output_key) is "
                              "null or missing; give the row its ground truth or drop the row (or set task.output_key "
                              "to the column that holds it)")

    def value(self, i: int, key: str, *default):
        """Row i's `key` (dotted: into structs) as a Python value (a MAP as a dict); `default` where the row has
        none."""
        root = self._root(key)
        if root not in self.table.column_names:
            if default:
                return default[0]
            raise KeyError(key)
        v = python_values(self.table.column(root)[i], f"task path '{self.path}' row {i} column '{root}'")
        if root in self.mixed and v is not None:
            v = json.loads(v)
        if root == key:
            return v
        try:
            return pick({root: v}, key)
        except KeyError:
            if default:
                return default[0]
            raise

    def held_out(self) -> np.ndarray:
        """[rows] bool: the rows whose prompt is held out for validation (pools.split_held_out of the distinct
        prompts), so every copy of a prompt falls on one side."""
        if self.in_json(self.input_key):  # the same text per prompt as _canonical gives a typed column
            canon = pa.chunked_array([pa.array([_canonical_text(self.value(i, self.input_key, None))
                                                for i in range(self.rows)], pa.string())])
        else:
            canon = _canonical(self.prompt)
        held = split_held_out(pc.unique(canon).to_pylist())[1]
        return pc.is_in(canon, value_set=pa.array(held, canon.type)).to_numpy(zero_copy_only=False)


def _canonical_text(prompt) -> str:
    """One prompt as _canonical makes it: text as it is; messages as role and content per line, joined."""
    if isinstance(prompt, str):
        return prompt
    return "\n\n".join(f"{m['role']}\n{m['content']}" for m in prompt)


def _column(table: pa.Table, key: str):
    """The (chunked) column that dotted `key` names, reaching into structs; None if there is none."""
    if key in table.column_names:
        return table.column(key)
    root, *parts = key.split(".")
    if root not in table.column_names:
        return None
    col = table.column(root)
    for part in parts:
        if not pa.types.is_struct(col.type) or col.type.get_field_index(part) < 0:
            return None
        col = pc.struct_field(col, part)
    return col


def _canonical(col: pa.ChunkedArray) -> pa.ChunkedArray:
    """A prompt column as one text per row: text as it is; chat messages as their roles and contents, joined."""
    if not pa.types.is_list(col.type) and not pa.types.is_large_list(col.type):
        return col.cast(pa.string()) if not pa.types.is_string(col.type) else col
    chunks = []
    for chunk in col.chunks:
        flat = chunk.flatten()
        lines = pc.binary_join_element_wise(pc.struct_field(flat, "role"), pc.struct_field(flat, "content"), "\n")
        offsets = pc.subtract(chunk.offsets, chunk.offsets[0])
        chunks.append(pc.binary_join(pa.ListArray.from_arrays(offsets, lines), "\n\n"))
    return pa.chunked_array(chunks, pa.string())


def check_prompts(col: pa.ChunkedArray, where: str, key: str) -> None:
    """Refuse a prompt column with a null, empty or malformed prompt, naming the first such row (vectorised: a
    1.8M-row file is checked in well under a second)."""
    t = col.type
    chat = (pa.types.is_list(t) or pa.types.is_large_list(t)) and pa.types.is_struct(t.value_type) and all(
        t.value_type.get_field_index(f) >= 0 for f in ("role", "content"))
    if not (pa.types.is_string(t) or pa.types.is_large_string(t) or chat):
        raise ConfigError(f"{where}: the prompt column '{key}' (task.input_key) holds {t}; it must hold text or chat "
                          "messages, a list of {role, content}")
    for part in ("role", "content") if chat else ():
        pt = t.value_type.field(part).type
        if not (pa.types.is_string(pt) or pa.types.is_large_string(pt)):  # verl's multimodal parts, a number
            has = pc.fill_null(pc.greater(pc.list_value_length(col), 0), False).to_numpy(zero_copy_only=False)
            raise ConfigError(f"{where} row {int(np.argmax(has))}: the chat messages' {part} ('{key}', "
                              f"task.input_key) holds {pt}, not text; only text is supported (not a list of parts, as "
                              f"for images): give each message's {part} as a string")
    start = 0
    for chunk in col.chunks:
        if chat:
            empty = pc.fill_null(pc.equal(pc.list_value_length(chunk), 0), True)
            flat = chunk.flatten()
            bad = pc.or_(pc.is_null(pc.struct_field(flat, "role")), pc.is_null(pc.struct_field(flat, "content")))
            parents = pc.list_parent_indices(chunk).to_numpy()
            bad_rows = np.sort(parents[bad.to_numpy(zero_copy_only=False)]) if len(flat) else parents[:0]
            candidates = list(bad_rows[:1]) + ([int(np.argmax(empty.to_numpy(zero_copy_only=False)))]
                                                if pc.any(empty).as_py() else [])
            first = int(min(candidates)) if candidates else None
            what = "a chat message with a null role or content, or no message"
        else:
            blank = pc.fill_null(pc.equal(pc.utf8_trim_whitespace(chunk), ""), True)
            first = int(np.argmax(blank.to_numpy(zero_copy_only=False))) if pc.any(blank).as_py() else None
            what = "null or empty"
        if first is not None:
            raise ConfigError(f"{where} row {start + first}: the prompt ('{key}', task.input_key) is {what}; fix or "
                              "drop the row")
        start += len(chunk)
