"""Row sets: a batch named by its (partition, rows) segments, and moving their columns through any store."""

from __future__ import annotations

from pathlib import Path
from typing import Sequence

import numpy as np
import pyarrow as pa

from dataplane_rl.store import ColumnStore

RowSet = list[tuple[str, np.ndarray]]  # [(partition id, rows)]


def rowset_size(rs: RowSet) -> int:
    return sum(len(r) for _, r in rs)


def fetch(store: ColumnStore, rs: RowSet, fields: Sequence[str]) -> pa.Table:
    """The fields of a row set, in row-set order (zero-copy chunks where the store allows)."""
    tables = [store.get(pid, fields, rows) for pid, rows in rs if len(rows)]
    if len(tables) == 1:
        return tables[0]
    return pa.concat_tables(tables) if tables else pa.table({})


def save_parquet(store: ColumnStore, rs: RowSet, path: Path) -> int:
    """The row set's rows, every column written on all of them, to a Parquet file (`store export`'s format:
    the schema in its metadata); returns the rows written."""
    from dataplane_rl.store.parquet import write_parquet, written_fields

    fields = None
    for pid, rows in rs:
        have = written_fields(store, pid, rows)
        fields = have if fields is None else [f for f in fields if f in have]
    if not fields:
        return 0
    table = fetch(store, rs, fields)
    write_parquet(table, store.schema(rs[0][0]), path, {"partitions": [pid for pid, _ in rs]})
    return table.num_rows


def write(store: ColumnStore, rs: RowSet, table: pa.Table) -> int:
    """Put a table whose rows follow the row set; returns bytes written."""
    start = 0
    for pid, rows in rs:
        part = table.slice(start, len(rows))
        store.put(pid, {name: part.column(name) for name in part.column_names}, rows)
        start += len(rows)
    if start != table.num_rows:
        raise ValueError(f"write: table has {table.num_rows} rows, the row set {start}")
    return table.nbytes


def shard_balanced(lengths: np.ndarray, num_shards: int) -> list[np.ndarray]:
    """Split positions 0..n-1 into `num_shards` equal-count shards with balanced token totals.

    Greedy longest-first onto the lightest shard that still has room; deterministic. Each shard's
    positions are returned sorted, so shards read contiguous runs where they can.
    """
    n = lengths.size
    if n % num_shards:
        raise ValueError(f"{n} rows do not split evenly over {num_shards} ranks")
    cap = n // num_shards
    load = np.zeros(num_shards, dtype=np.int64)
    members: list[list[int]] = [[] for _ in range(num_shards)]
    for i in np.argsort(-lengths, kind="stable"):
        open_ = [s for s in range(num_shards) if len(members[s]) < cap]
        s = min(open_, key=lambda k: (load[k], k))
        members[s].append(int(i))
        load[s] += int(lengths[i])
    return [np.array(sorted(m), dtype=np.int64) for m in members]


def merge(parts: list[RowSet]) -> RowSet:
    """The row sets one after another, adjacent segments of one partition joined."""
    out: RowSet = []
    for rs in parts:
        for pid, rows in rs:
            if out and out[-1][0] == pid:
                out[-1] = (pid, np.concatenate([out[-1][1], rows]))
            else:
                out.append((pid, rows))
    return out


def select(rs: RowSet, positions: np.ndarray) -> RowSet:
    """The sub-row-set at flat positions (sorted), keeping segment boundaries."""
    out: RowSet = []
    start = 0
    for pid, rows in rs:
        mine = positions[(positions >= start) & (positions < start + len(rows))] - start
        if mine.size:
            out.append((pid, rows[mine]))
        start += len(rows)
    return out
