"""Rows: user row arguments to checked row ids, and gathering a column's rows out of decoded blocks."""

from __future__ import annotations

from typing import Any

import numpy as np
import pyarrow as pa

from dataplane_rl.errors import AlignmentError, format_rows
from dataplane_rl.store.arrow import as_numpy


def row_ids(pid: str, n: int, rows: Any, *, unique: bool) -> np.ndarray:
    """`rows` (None: all, a range, a slice, or integer indices) as int64 row ids of a partition of `n` rows,
    checked to be in range (and, for a put, unique)."""
    if rows is None:
        return np.arange(n, dtype=np.int64)
    if isinstance(rows, slice):
        try:
            rows = range(*rows.indices(n))
        except (TypeError, ValueError) as e:
            raise AlignmentError(f"partition {pid}: rows slice {rows} is not a slice of integers ({e})") from None
    if isinstance(rows, range):
        # checked on the ends, before any row list is made: range(10**18) must not allocate
        if not rows:  # an empty range's start, stop and step may be any size (past int64, or a length numpy refuses)
            return np.empty(0, np.int64)
        if min(rows[0], rows[-1]) < 0 or max(rows[0], rows[-1]) >= n:
            raise AlignmentError(f"partition {pid}: rows {rows.start}-{rows.stop - 1} (step {rows.step}) out of "
                                 f"range; the partition has {n} rows (0-{n - 1})")
        if len(rows) == 1:  # its step may be past int64
            return np.array([rows[0]], np.int64)
        # from its ends, which are in range (so is |step| < n): unique and in range
        return np.arange(rows[0], rows[-1] + (1 if rows.step > 0 else -1), rows.step, dtype=np.int64)
    try:
        arr = as_numpy(rows)
    except (TypeError, ValueError, OverflowError) as e:
        raise AlignmentError(f"partition {pid}: rows must be a range or 1-D integer indices ({e})") from None
    if arr.ndim != 1 or (arr.size and not np.issubdtype(arr.dtype, np.integer)):
        raise AlignmentError(f"partition {pid}: rows must be a range or 1-D integer indices, got {arr.dtype} "
                             f"shape {arr.shape}")
    out = arr.astype(np.int64, copy=False)
    bad = out[(out < 0) | (out >= n)]
    if bad.size:
        raise AlignmentError(f"partition {pid}: rows {format_rows(bad)} out of range; the partition has {n} rows")
    if unique and out.size > 1:
        s = np.sort(out)  # not np.unique: its first call imports numpy.ma (~15 ms in a fresh process)
        again = s[1:][s[1:] == s[:-1]]
        if again.size:
            raise AlignmentError(f"partition {pid}: rows {format_rows(sorted(set(again.tolist())))} given more than "
                                 "once in one put")
    return out


def distinct(which: np.ndarray) -> list[int]:
    """The distinct values of small non-negative ints (block numbers), sorted. Not np.unique: its first
    call in a process imports numpy.ma, ~15 ms of a reader's first get."""
    return np.flatnonzero(np.bincount(which)).tolist() if which.size else []


def rows_text(rows: np.ndarray) -> str:
    """format_rows(rows) without its per-row Python loop in the common case, a contiguous put."""
    if rows.size > 1 and rows[-1] - rows[0] == rows.size - 1 and bool(np.all(np.diff(rows) == 1)):
        return f"{rows[0]}-{rows[-1]}"
    return format_rows(rows)


def runs_of(which: np.ndarray, pos: np.ndarray) -> list[tuple[int, int, int]] | None:
    """(block, first position, length) of each run of consecutive rows within one block, or None when
    the rows are so scattered (more than two runs per block they touch) that a take beats many slices."""
    n = which.size
    if not n:
        return []
    breaks = np.flatnonzero((which[1:] != which[:-1]) | (pos[1:] != pos[:-1] + 1)) + 1
    starts = [0, *breaks.tolist()]
    blocks = which[starts].tolist()
    if len(starts) > 8 and len(starts) > 2 * len(set(blocks)):
        return None
    ends = [*starts[1:], n]
    return [(b, p, e - s) for b, p, s, e in zip(blocks, pos[starts].tolist(), starts, ends)]


def gather(batches: dict[int, pa.RecordBatch], plan, names: list[str], types: list[pa.DataType]) -> list:
    """Columns `names` (of Arrow types `types`) for the rows at (block `which`, position `pos`), one
    Arrow call per run or per block for all of them, not one per column. Runs of consecutive rows
    within a block become zero-copy slices (a shard of a put costs no copy); scattered rows are gathered
    with one take over the blocks holding them."""
    which, pos, runs = plan
    if not which.size:
        return [pa.array([], type=t) for t in types]
    if runs is not None:
        if len(runs) == 1:
            b, p, n = runs[0]
            return batches[b].select(names).slice(p, n).columns
        picked = {b: batches[b].select(names) for b in {b for b, _, _ in runs}}
        pieces = pa.Table.from_batches([picked[b].slice(p, n) for b, p, n in runs])
        return pieces.columns
    keys = distinct(which)  # the blocks holding these rows
    if len(keys) > 1:
        sizes = np.array([batches[k].num_rows for k in keys], dtype=np.int64)
        base = np.zeros(max(keys) + 1, dtype=np.int64)
        base[keys] = np.concatenate([[0], np.cumsum(sizes)[:-1]])
        combined = pa.Table.from_batches([batches[k].select(names) for k in keys])  # no copy before the take
        idx = base[which] + pos
    else:
        combined, idx = batches[keys[0]].select(names), pos
    return combined.take(pa.array(idx)).columns


class PutWhere:
    """'partition P put rows R:', the prefix of a put's errors, formatted only when an error is raised."""

    __slots__ = ("pid", "rows")

    def __init__(self, pid: str, rows: np.ndarray) -> None:
        self.pid, self.rows = pid, rows

    def __str__(self) -> str:
        return f"partition {self.pid} put rows {rows_text(self.rows)}:"

    def __format__(self, spec: str) -> str:
        return format(str(self), spec)
