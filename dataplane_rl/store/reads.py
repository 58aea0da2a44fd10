"""How a get becomes an Arrow table: the blocks holding the rows, read, checksummed where the rows lie, sliced or taken.

`table` is given everything it uses — the snapshot, its row index, the storage's `read` and the counters
to add the bytes read to — so it holds no state and reaches into no store.
"""

from __future__ import annotations

from functools import lru_cache
from typing import Any, Callable

import numpy as np
import pyarrow as pa

from dataplane_rl.errors import CorruptChunkError, MissingColumnError, format_rows
from dataplane_rl.store.arrow import block_columns, block_schema, schema_of
from dataplane_rl.store.chunks import ChunkRef, Mismatch, PartitionMeta, Snapshot, decode_block
from dataplane_rl.store.index import RowIndex, as_slice
from dataplane_rl.store.rows import distinct, gather, runs_of
from dataplane_rl.store.stats import Counters

Read = Callable[[str, "list[ChunkRef]"], "list[pa.Buffer]"]  # Storage.read


def table(snap: Snapshot, idx: RowIndex, fields: list[str], rows: np.ndarray, read: Read, counters: Counters) -> pa.Table:
    """`fields` of `rows` from the blocks of `snap`: each block read and checksummed once, and rows
    that are runs within blocks served as zero-copy slices of the mapped record batches."""
    meta, schema = snap.meta, schema_of(snap.meta)
    table = _tiled(snap, idx, fields, rows, read, counters)
    if table is not None:
        return table
    # fields written together share a plan (the same blocks at the same positions): one per distinct
    # (which, pos), found by their bytes instead of comparing every pair of arrays
    groups: dict[bytes, list] = {}  # -> [which, pos, field positions]
    with idx.lock:
        refs = idx.refs
        for i, f in enumerate(fields):
            owner = idx.owner.get(f)
            if owner is None:
                which = pos = np.full(rows.size, -1, dtype=np.int32)
            else:
                which, pos = owner[rows], idx.pos[f][rows]
            key = which.tobytes() + pos.tobytes()
            g = groups.get(key)
            if g is not None:
                g[2].append(i)
                continue
            if rows.size and int(which.min()) < 0:
                missing = rows[which < 0]
                raise MissingColumnError(f"partition {meta.pid} column '{f}' rows {format_rows(missing)} not "
                                         f"written (writer: {schema.by_name[f].writer})")
            groups[key] = [which, pos, [i]]
    if not rows.size:
        used = []
    elif len(groups) == 1:
        used = distinct(next(iter(groups.values()))[0])
    else:
        used = distinct(np.concatenate([g[0] for g in groups.values()]))
    needed = [refs[i] for i in used]
    plans = [(which, pos, runs_of(which, pos), where) for which, pos, where in groups.values()]
    lo, hi = _spans(plans, len(refs))
    counters.values["get_bytes_total"] += sum(r.nbytes for r in needed)
    want = set(fields)
    batches = {b: _decode(meta, r, p, want, lo[b], hi[b])
               for b, r, p in zip(used, needed, read(meta.pid, needed))}
    out_schema = block_schema(meta.schema_json, tuple(fields))
    if len(plans) == 1 and plans[0][2] is not None:  # the common case: one slice of a record batch per run
        pieces = [batches[b].slice(p, n) for b, p, n in plans[0][2]]
        pieces = [x if x.schema.names == fields else x.select(fields) for x in pieces]
        table = pa.Table.from_batches(pieces, schema=out_schema)
    else:
        cols: list[Any] = [None] * len(fields)
        for which, pos, runs, where in plans:
            names = [fields[i] for i in where]
            types = [schema.by_name[f].arrow_type for f in names]
            for i, col in zip(where, gather(batches, (which, pos, runs), names, types)):
                cols[i] = col
        table = pa.Table.from_arrays(cols, schema=out_schema)
    _learn_lengths(snap, idx, table, fields, rows)
    return table


def _tiled(snap: Snapshot, idx: RowIndex, fields: list[str], rows: np.ndarray, read: Read,
           counters: Counters) -> pa.Table | None:
    """The common get, without a per-row plan: contiguous rows that, per field, lie in blocks each holding
    a contiguous run of rows (puts of ranges), so a field is its blocks' arrays in order, each block
    decoded once over just the rows read (no record batch, no slice). None otherwise."""
    run = as_slice(rows)
    if not isinstance(run, slice):
        return None
    with idx.lock:
        refs = idx.refs
        groups = idx.tiling(fields, run.start, run.stop)
    if groups is None:
        return None
    # block -> [its rows read, lo..hi (every field's: a block holds one run, the rows are one run), field
    # positions], in row order
    spans: dict[int, list] = {}
    for tiles, where in groups:
        for k, lo, hi in tiles:
            span = spans.get(k)
            if span is None:
                spans[k] = [lo, hi, where]
            else:  # also read by fields whose other rows other puts hold: decoded once
                span[2] = span[2] + where
    meta = snap.meta
    used = list(spans)
    needed = [refs[k] for k in used]
    counters.values["get_bytes_total"] += sum(r.nbytes for r in needed)
    names: dict[int, tuple[str, ...]] = {}  # id(field positions) -> their names, made once per plan
    for k, ref, payload in zip(used, needed, read(meta.pid, needed)):
        span = spans[k]
        what = names.get(id(span[2])) or names.setdefault(id(span[2]), tuple(fields[i] for i in span[2]))
        span.append(_arrays(meta, ref, payload, what, span[0], span[1]))
    schema = block_schema(meta.schema_json, tuple(fields))
    cols: list[Any] = [None] * len(fields)
    for tiles, where in groups:
        per_block = []
        for k, _, _ in tiles:
            _, _, order, arrays = spans[k]
            per_block.append(arrays if order is where else [arrays[order.index(i)] for i in where])
        for i, pieces in zip(where, zip(*per_block)):
            cols[i] = pa.chunked_array(pieces, type=schema.field(i).type)
    table = pa.Table.from_arrays(cols, schema=schema)
    _learn_lengths(snap, idx, table, fields, rows)
    return table


def _learn_lengths(snap: Snapshot, idx: RowIndex, table: pa.Table, fields: list[str], rows: np.ndarray) -> None:
    """A get that read the length column tells later puts of token columns what to check against."""
    length_col = schema_of(snap.meta).length_column
    if length_col in fields and rows.size:
        lengths = table.column(fields.index(length_col)).to_numpy()
        with idx.lock:
            idx.learn_lengths(rows, lengths)


def _decode(meta: PartitionMeta, ref: ChunkRef, payload: pa.Buffer, fields: set[str], lo: int,
            hi: int) -> pa.RecordBatch:
    """`fields` of a stored block as a record batch of all its rows, of which rows lo..hi-1 (and only
    those) are checksummed."""
    names = tuple(c for c in ref.columns if c in fields)
    return pa.RecordBatch.from_arrays(_arrays(meta, ref, payload, names, lo, hi, whole=True),
                                      schema=block_schema(meta.schema_json, names))


def _arrays(meta: PartitionMeta, ref: ChunkRef, payload: pa.Buffer, names: tuple[str, ...], lo: int,
            hi: int, whole: bool = False) -> list[pa.Array]:
    """Columns `names` of a stored block over its rows lo..hi-1 (all its rows if `whole`; only lo..hi-1
    are checksummed)."""
    try:
        if payload.size != ref.nbytes:
            raise Mismatch()
        return decode_block(payload, ref, block_columns(meta.schema_json, ref.columns),
                            _positions(ref.columns, names), lo, hi, whole)
    except Mismatch:
        what = "missing (evicted or lost)" if payload.size == 0 else f"corrupt ({payload.size} bytes, checksum mismatch)"
        cols = ", ".join(f"'{c}'" for c in ref.columns)
        raise CorruptChunkError(f"partition {meta.pid} column(s) {cols} rows {format_rows(ref.rows)}: stored block "
                                f"{ref.key} is {what}; the data is gone, regenerate the step") from None


@lru_cache(maxsize=1024)


def _positions(columns: tuple[str, ...], names: tuple[str, ...]) -> tuple[int, ...]:
    """Where each of `names` is in a block of `columns`."""
    return tuple(columns.index(c) for c in names)


def _spans(plans: list, nrefs: int) -> tuple[list[int], list[int]]:
    """Per block: the first and one past the last of its positions that the plans read (what it must
    checksum)."""
    lo, hi = [1 << 62] * nrefs, [0] * nrefs
    for which, pos, runs, _ in plans:
        if runs is None:
            first, last = np.full(nrefs, 1 << 62, dtype=np.int64), np.zeros(nrefs, dtype=np.int64)
            np.minimum.at(first, which, pos)
            np.maximum.at(last, which, pos + 1)
            runs = [(b, int(first[b]), int(last[b] - first[b])) for b in np.flatnonzero(last).tolist()]
        for b, p, n in runs:
            lo[b], hi[b] = min(lo[b], p), max(hi[b], p + n)
    return lo, hi
