"""Deterministic test columns, and the functions store tests run in other processes.

Every value is a function of (row, seed), so any process can write or check any subset of rows without
shipping data around. Worker functions open the store by URL, as a real writer or reader would.
"""

from __future__ import annotations

import os
from typing import Iterable, Sequence

import numpy as np

from dataplane_rl.config import bound_schema
from dataplane_rl.errors import DuplicateWriteError
from dataplane_rl.schema import ARROW_DTYPES, GRPO_SCHEMA, Column, Schema

GRPO = bound_schema()  # what a partition created as "grpo" holds: the teacher columns at the default k
ROLLOUT_FIELDS = tuple(c.name for c in GRPO_SCHEMA.columns if c.writer == "rollout")


def row_len(r: int, seed: int = 0) -> int:
    return 1 + (int(r) * 7 + seed) % 11


def _token(name: str, r: int, n: int, seed: int) -> np.ndarray:
    base = np.arange(n, dtype=np.int64) + int(r) * 100 + seed
    if name == "input_ids":
        return base.astype(np.int32)
    if name == "token_mask":
        return (base % 2).astype(np.int8)
    if name == "turn_index":
        return (base % 3).astype(np.int16)
    if name == "token_policy_version":
        return (base % 4 - 1).astype(np.int32)  # -1 (prompt or environment token) or a weight version
    shape = GRPO.by_name[name].shape
    if shape:  # a shaped column (a teacher's top-k): [n, *shape], every value a function of (row, token, slot)
        grid = base.reshape(-1, *[1] * len(shape)) * 1000 + np.arange(int(np.prod(shape))).reshape(shape)
        if GRPO_SCHEMA.by_name[name].dtype == "int32":
            return grid.astype(np.int32)
        return (-(grid % 997) / np.float32(16)).astype(np.float32)
    return (-(base % 97) / np.float32(8)).astype(np.float32)  # log-prob-like, exact in float32


def _sample(name: str, rows: np.ndarray, seed: int):
    if name == "input_lengths":
        return np.array([row_len(r, seed) for r in rows], dtype=np.int32)
    if name in ("total_reward", "advantages"):
        return (rows * 0.5 + seed - (5 if name == "advantages" else 0)).astype(np.float32)
    if name == "group_id":
        return (rows // 4 + seed).astype(np.int64)
    if name == "generation_policy_version":
        return (rows % 3 + seed).astype(np.int64)
    if name == "truncated":
        return (rows + seed) % 3 == 0
    if name == "sample_mask":
        return ((rows + seed) % 5 != 0).astype(np.int8)
    if name == "num_turns":
        return (rows % 3 + 1 + seed).astype(np.int32)
    if name == "observation_tokens":
        return (rows % 4 + seed).astype(np.int32)
    if name == "dataset_row":
        return (rows // 4 * 7 + seed - 1).astype(np.int64)  # -1 on a task without rows
    if GRPO_SCHEMA.by_name[name].dtype != "string":
        raise KeyError(f"store_workers._sample has no generator for the grpo column '{name}'; add one")
    return [f"{name} {r} seed {seed} ✓" for r in rows]  # prompt_text, response_text


def grpo_columns(rows: Iterable[int], fields: Sequence[str] | None = None, seed: int = 0) -> dict:
    """GRPO columns for `rows`, in the given row order."""
    rows = np.asarray(list(rows) if not isinstance(rows, np.ndarray) else rows, dtype=np.int64)
    out = {}
    for name in fields or GRPO_SCHEMA.names:
        col = GRPO_SCHEMA.by_name[name]
        if col.kind == "token":
            out[name] = [_token(name, r, row_len(r, seed), seed) for r in rows]
        else:
            out[name] = _sample(name, rows, seed)
    return out


def all_dtypes_schema() -> Schema:
    """A schema with one sample column per dtype and one token column per non-string dtype."""
    cols = [Column(name="input_lengths", dtype="int32", kind="sample", writer="rollout")]
    for dt in ARROW_DTYPES:
        cols.append(Column(name=f"s_{dt}", dtype=dt, kind="sample", writer="driver"))
        if dt != "string":
            cols.append(Column(name=f"t_{dt}", dtype=dt, kind="token", writer="policy"))
            cols.append(Column(name=f"k_{dt}", dtype=dt, kind="token", writer="teacher", shape=[3]))
    cols.append(Column(name="m_int16", dtype="int16", kind="token", writer="rollout", shape=[2, 3]))  # router-like
    return Schema(name="all_dtypes", columns=tuple(cols))


def all_dtypes_columns(rows: Sequence[int], seed: int = 0) -> dict:
    rows = np.asarray(rows, dtype=np.int64)
    lengths = np.array([row_len(r, seed) for r in rows], dtype=np.int32)
    out: dict = {"input_lengths": lengths}
    for dt, at in ARROW_DTYPES.items():
        if dt == "string":
            out[f"s_{dt}"] = [f"row {r} ✓ {seed}" for r in rows]
            continue
        np_dt = np.dtype(at.to_pandas_dtype())
        out[f"s_{dt}"] = ((rows + seed) % 2 == 0) if dt == "bool" else ((rows * 3 + seed) % 100).astype(np_dt)
        out[f"t_{dt}"] = [((np.arange(n) + r + seed) % (2 if dt == "bool" else 100)).astype(np_dt)
                          for r, n in zip(rows, lengths)]
        out[f"k_{dt}"] = [((np.arange(3 * n).reshape(n, 3) * 7 + r + seed) % (2 if dt == "bool" else 100)).astype(np_dt)
                          for r, n in zip(rows, lengths)]  # [L, 3]: bool packs bits across tokens
    out["m_int16"] = [(np.arange(6 * n).reshape(n, 2, 3) - 300 * r - seed).astype(np.int16)
                      for r, n in zip(rows, lengths)]  # [L, 2, 3]
    return out


def as_lists(data) -> list:
    """Plain Python values of user data or of an Arrow column, for comparisons."""
    if hasattr(data, "to_pylist"):
        return data.to_pylist()
    if isinstance(data, np.ndarray):
        return data.tolist()
    return [x.tolist() if isinstance(x, np.ndarray) else x for x in data]


# ---- run in other processes -------------------------------------------------------------------------
_STORES: dict = {}


def _store(url: str):
    """Stores whose clients are slow to start (ray, mooncake) are kept per process; shm opens are cheap."""
    from dataplane_rl.store import open_store

    if url.startswith("shm://"):
        return open_store(url)
    if url not in _STORES:
        _STORES[url] = open_store(url)
    return _STORES[url]


def _done(store, url: str) -> None:
    if url.startswith("shm://"):
        store.close()


def write(url: str, pid: str, rows: Sequence[int], fields: Sequence[str] = ROLLOUT_FIELDS, seed: int = 0,
          puts: int = 1) -> int:
    """Write `fields` for `rows` in `puts` puts; returns this process id."""
    store = _store(url)
    for part in np.array_split(np.asarray(rows, dtype=np.int64), puts):
        store.put(pid, grpo_columns(part, fields, seed), part)
    _done(store, url)
    return os.getpid()


def check(url: str, pid: str, rows: Sequence[int], fields: Sequence[str], seed: int = 0, repeat: int = 3) -> int:
    """Read `fields` for `rows` `repeat` times and compare with the expected values; returns rows checked."""
    store = _store(url)
    want = {k: as_lists(v) for k, v in grpo_columns(rows, fields, seed).items()}
    for _ in range(repeat):
        table = store.get(pid, fields, rows)
        for f in fields:
            assert table.column(f).to_pylist() == want[f], f"{f} differs in process {os.getpid()}"
    _done(store, url)
    return len(rows) * repeat


def race(url: str, pids: Sequence[str], rows: Sequence[int], seed: int) -> list[str]:
    """Try to write the same cells as a competing process: 'ok' or 'dup' per partition."""
    store = _store(url)
    out = []
    for pid in pids:
        try:
            store.put(pid, grpo_columns(rows, ("input_lengths", "total_reward"), seed), rows)
            out.append("ok")
        except DuplicateWriteError:
            out.append("dup")
    _done(store, url)
    return out


def big_block(block: int, rows: int, per_row: int) -> dict:
    """Rollout token columns of one block of `rows` rows with `per_row` tokens each (~9 bytes a token)."""
    vals = [np.arange(per_row, dtype=np.int32) + block for _ in range(rows)]
    return {"input_lengths": np.full(rows, per_row, np.int32), "input_ids": vals,
            "token_mask": [(v % 2).astype(np.int8) for v in vals],
            "generation_logprobs": [-(v % 7).astype(np.float32) for v in vals]}


def put_blocks(url: str, pid: str, rows: int, per_row: int, started, done) -> None:
    """Put block after block until killed; `started`/`done` (shared ints) say which put is in flight."""
    store = _store(url)
    for block in range(10**6):
        started.value = block
        store.put(pid, big_block(block, rows, per_row), range(block * rows, (block + 1) * rows))
        done.value = block


def wait_then_check(url: str, pid: str, rows: Sequence[int], fields: Sequence[str], timeout: float = 60.0) -> list[int]:
    """Wait (store.wait) until `fields` are written on `rows`, then check their values; returns the rows
    wait returned."""
    store = _store(url)
    got = store.wait(pid, list(fields), list(rows), timeout=timeout)
    want = {k: as_lists(v) for k, v in grpo_columns(rows, fields).items()}
    table = store.get(pid, list(fields), rows)
    for f in fields:
        assert table.column(f).to_pylist() == want[f], f"{f} differs in process {os.getpid()}"
    _done(store, url)
    return got.tolist()


def commit_loop(url: str, pid: str, group: int, fields: Sequence[str], in_commit, done) -> None:
    """Put groups of `group` rows, one after another, until killed; `in_commit` (a shared int) is 1 while a
    commit is in flight, so the test can kill this process inside one, and `done` counts committed puts."""
    store = _store(url)
    commit = store.storage.commit

    def flagged(*args):
        in_commit.value = 1
        commit(*args)
        in_commit.value = 0

    store.storage.commit = flagged
    for g in range(store.num_rows(pid) // group):
        rows = range(g * group, (g + 1) * group)
        store.put(pid, grpo_columns(rows, fields), rows)
        done.value = g + 1


def poll_whole_groups(url: str, pids: Sequence[str], group: int, fields: Sequence[str], stop, out) -> None:
    """Until `stop` (an Event) is set, look at each partition of `pids` that exists: the rows ready on any
    field must be ready on every field and come in whole groups, and read back right. Puts the looks taken,
    or what went wrong, on the queue `out`."""
    try:
        out.put(_poll(url, pids, group, fields, stop))
    except BaseException as e:
        out.put(f"reader {os.getpid()}: {e!r}")


def _poll(url: str, pids: Sequence[str], group: int, fields: Sequence[str], stop) -> int:
    from dataplane_rl.errors import PartitionNotFoundError

    store = _store(url)
    looks = 0
    while not stop.is_set():
        for pid in pids:
            try:
                # commits only add whole puts: a row ready on any field before is ready on all of them after
                anyone = np.unique(np.concatenate([store.ready(pid, f) for f in fields]))
                every = store.ready(pid, list(fields))
            except PartitionNotFoundError:
                continue
            half = np.setdiff1d(anyone, every)
            assert not half.size, f"{pid}: rows {half.tolist()} have part of a put"
            starts = every[::group]
            assert every.size % group == 0 and np.array_equal(every, (starts[:, None] + np.arange(group)).ravel()), \
                f"{pid}: ready rows {every.tolist()} are not whole groups of {group}"
            if every.size:
                table = store.get(pid, list(fields), every)
                want = grpo_columns(every, fields)
                for f in fields:
                    assert table.column(f).to_pylist() == as_lists(want[f]), f"{pid} {f} differs"
            looks += 1
    _done(store, url)
    return looks


def put_groups(url: str, pid: str, groups: Sequence[int], group_rows: int, done) -> None:
    """Put each of `groups` (rows g*group_rows...) with every rollout field in one put; `done` (a shared
    int) counts the puts that returned. Runs until killed or done."""
    store = _store(url)
    for g in groups:
        rows = range(g * group_rows, (g + 1) * group_rows)
        store.put(pid, grpo_columns(rows, ROLLOUT_FIELDS), rows)
        done.value += 1


def watch_commits(url: str, pid: str, group_rows: int, stop, out) -> None:
    """Until `stop` is set: look at the partition over and over and check that every put is whole: each
    rollout field written on the same rows, whole groups only, and those rows read back as written.
    Puts (looks, what it saw wrong) on the queue `out`."""
    store = _store(url)
    looks, wrong = 0, []
    while not stop.value or looks == 0:
        try:
            written = store.status(pid).rows_written
            counts = {f: written[f] for f in ROLLOUT_FIELDS}
            if len(set(counts.values())) != 1 or counts["input_ids"] % group_rows:
                wrong.append(f"look {looks}: rows written per field {counts}")
            rows = store.ready(pid, ROLLOUT_FIELDS)
            if len(rows):
                table = store.get(pid, ROLLOUT_FIELDS, rows)
                want = grpo_columns(rows, ROLLOUT_FIELDS)
                bad = [f for f in ROLLOUT_FIELDS if table.column(f).to_pylist() != as_lists(want[f])]
                if bad:
                    wrong.append(f"look {looks}: fields {bad} of rows {rows[:3]}.. differ")
        except Exception as e:  # e.g. a committed block that is not there: half a put
            wrong.append(f"look {looks}: {type(e).__name__}: {e}")
        looks += 1
    out.put((looks, wrong))
