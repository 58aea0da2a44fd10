"""`bench store`'s workload: a GRPO-shaped batch of DP_TRAIN_FIELDS (with `--topk`, a teacher's top-k too), and touching every byte a reader got."""

from __future__ import annotations

import functools
import statistics

import numpy as np
import pyarrow as pa

from dataplane_rl.store.arrow import flat_values


@functools.lru_cache(maxsize=8)
def bench_schema(topk: int = 0):
    """The grpo schema, with its teacher columns [topk] per token when `--topk` adds them to the workload."""
    from dataplane_rl.schema import GRPO_SCHEMA, Schema

    if not topk:
        return GRPO_SCHEMA
    doc = GRPO_SCHEMA.model_dump()
    for c in doc["columns"]:
        if c["writer"] == "teacher":
            c["shape"] = [topk]
    return Schema(**doc, source=GRPO_SCHEMA.source)


def bench_fields(topk: int = 0) -> tuple[str, ...]:
    """DP_TRAIN_FIELDS, and the teacher's columns with `--topk` (what a distillation step's readers fetch)."""
    from dataplane_rl.schema import DP_TRAIN_FIELDS

    teacher = tuple(c.name for c in bench_schema(topk).columns if c.writer == "teacher") if topk else ()
    return (*DP_TRAIN_FIELDS, *teacher)


def make_batch(samples: int, min_len: int, max_len: int, seed: int = 0, topk: int = 0) -> dict[str, pa.Array]:
    """`bench_fields(topk)` for `samples` rows, as Arrow arrays of the declared types (a teacher column:
    [L, topk] per row)."""
    from dataplane_rl.store import list_array

    schema = bench_schema(topk)
    rng = np.random.default_rng(seed)
    lengths = rng.integers(min_len, max_len + 1, size=samples).astype(np.int32)
    total = int(lengths.sum())
    out: dict[str, pa.Array] = {}
    for name in bench_fields(topk):
        col = schema.column(name)
        np_type = np.dtype(col.value_type.to_pandas_dtype())
        n = (total if col.kind == "token" else samples, *col.shape)
        if name == "input_lengths":
            values = lengths
        elif np.issubdtype(np_type, np.floating):
            values = rng.standard_normal(n).astype(np_type)
        else:
            values = rng.integers(0, 2 if np_type.itemsize == 1 else 50_000, size=n).astype(np_type)
        out[name] = list_array(values, lengths, col.token_type) if col.kind == "token" else \
            pa.array(values, type=col.value_type)
    return out


def payload_bytes(batch: dict[str, pa.Array]) -> int:
    return sum(a.nbytes for a in batch.values())


def views_of(obj) -> list[np.ndarray]:
    """Zero-copy numpy views of exactly the bytes a (possibly sliced) column holds for its rows."""
    if isinstance(obj, pa.Table):
        return [v for c in obj.columns for v in views_of(c)]
    if isinstance(obj, pa.ChunkedArray):
        return [v for c in obj.chunks for v in views_of(c)]
    if pa.types.is_list(obj.type):
        offsets = obj.offsets  # sliced to this array's rows
        o = offsets.to_numpy(zero_copy_only=True)
        return [o, *views_of(obj.values.slice(int(o[0]), int(o[-1] - o[0])))]
    if pa.types.is_fixed_size_list(obj.type):  # a shaped column's tokens: their flat values
        return views_of(flat_values(obj)[0])
    return [obj.to_numpy(zero_copy_only=True)]


def touch(arrays) -> int:
    """Read every byte (an xor over 8-byte words where aligned, the rest byte-wise); returns bytes read.
    A few numpy calls per array: the per-array cost counts against whoever hands out more pieces."""
    n = 0
    xor = np.bitwise_xor.reduce
    for arr in arrays:
        a = arr.view(np.uint8) if arr.ndim == 1 and arr.flags.c_contiguous else \
            np.ascontiguousarray(arr).reshape(-1).view(np.uint8)
        size = a.size
        n += size
        head = size & ~7 if a.ctypes.data & 7 == 0 else 0
        if head:
            xor(a[:head].view(np.uint64))
        if head < size:
            xor(a[head:])
    return n


def _stats(xs: list[float]) -> dict[str, float]:
    return {"median": statistics.median(xs), "min": min(xs), "max": max(xs)}


# ---- worker processes ------------------------------------------------------------------------------
