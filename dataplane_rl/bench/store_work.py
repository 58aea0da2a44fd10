"""`bench store`'s workload: a GRPO-shaped batch of DP_TRAIN_FIELDS (`--topk`: and a teacher's top-k) cut into
groups, and touching what a reader got."""

from __future__ import annotations

import functools
import statistics
from dataclasses import dataclass

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


def _columns(topk: int):
    """(column, bytes per token or per sample) of each field of the workload, in bench_fields order."""
    schema = bench_schema(topk)
    cols = [schema.column(n) for n in bench_fields(topk)]
    return [(c, np.dtype(c.value_type.to_pandas_dtype()).itemsize * int(np.prod(c.shape, dtype=np.int64))) for c in cols]


def row_lengths(samples: int, min_len: int, max_len: int, seed: int = 0) -> np.ndarray:
    """The batch's row lengths in tokens, uniform in [min_len, max_len], the same for every process."""
    return np.random.default_rng(seed).integers(min_len, max_len + 1, size=samples).astype(np.int32)


def make_columns(lengths: np.ndarray, rng: np.random.Generator, topk: int = 0) -> dict[str, pa.Array]:
    """bench_fields(topk) for rows of these lengths, as Arrow arrays of the declared types (a teacher column:
    [L, topk] per row)."""
    from dataplane_rl.store import list_array

    lengths = np.asarray(lengths, dtype=np.int32)
    total, samples = int(lengths.sum()), len(lengths)
    out: dict[str, pa.Array] = {}
    for col, _ in _columns(topk):
        name = col.name
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


def make_batch(samples: int, min_len: int, max_len: int, seed: int = 0, topk: int = 0) -> dict[str, pa.Array]:
    """bench_fields(topk) for `samples` rows in one batch."""
    rng = np.random.default_rng(seed)
    lengths = rng.integers(min_len, max_len + 1, size=samples).astype(np.int32)
    return make_columns(lengths, rng, topk)


def group_ranges(samples: int, group_size: int, writers: int = 1) -> list[tuple[int, int]]:
    """The rows of each put, in row order: groups of `group_size` rows (the last one may be short), or with
    group_size 0 one contiguous block per writer (each writer's rows in a single put)."""
    size = group_size or -(-samples // writers)
    return [(lo, min(samples, lo + size)) for lo in range(0, samples, size)]


def writer_groups(groups: list, w: int, writers: int) -> list:
    """Writer w's groups, interleaved as a run's rollout actors finish theirs: w, w + N, w + 2N, ..."""
    return groups[w::writers]


def make_groups(samples: int, min_len: int, max_len: int, ranges: list[tuple[int, int]],
                seed: int = 0, topk: int = 0) -> list[dict[str, pa.Array]]:
    """Each group's columns as arrays of their own (as an actor builds them), of the batch's row lengths."""
    lengths = row_lengths(samples, min_len, max_len, seed)
    return [make_columns(lengths[lo:hi], np.random.default_rng([seed, lo, hi]), topk) for lo, hi in ranges]


def piece_sizes(lengths: np.ndarray, topk: int = 0) -> list[int]:
    """Bytes of each buffer views_of() gives for rows of these lengths (offsets then values per token column)."""
    out = []
    for col, size in _columns(topk):
        if col.kind == "token":
            out += [(len(lengths) + 1) * 4, int(np.sum(lengths, dtype=np.int64)) * size]
        else:
            out.append(len(lengths) * size)
    return out


def shard_pieces(lengths: np.ndarray, ranges: list[tuple[int, int]], starts: list[int], lo: int,
                 hi: int, topk: int = 0) -> list[tuple[int, int]]:
    """(offset, bytes) in a group-major layout (group g's buffers back to back from starts[g]) of the
    pieces rows lo..hi-1 cover: what views_of() gives of those rows, one piece per group and buffer."""
    kinds = [(col.kind, size) for col, size in _columns(topk)]
    out = []
    for (g0, g1), start in zip(ranges, starts):
        a, b = max(lo, g0) - g0, min(hi, g1) - g0
        if a >= b:
            continue
        cum = np.concatenate([[0], np.cumsum(lengths[g0:g1], dtype=np.int64)])
        at = start
        for kind, size in kinds:
            if kind == "token":
                out.append((at + a * 4, (b - a + 1) * 4))
                at += (g1 - g0 + 1) * 4
                out.append((at + int(cum[a]) * size, int(cum[b] - cum[a]) * size))
                at += int(cum[-1]) * size
            else:
                out.append((at + a * size, (b - a) * size))
                at += (g1 - g0) * size
    return [p for p in out if p[1]]


def batch_bytes(samples: int, min_len: int, max_len: int, topk: int = 0) -> int:
    """About the bytes make_batch gives for these arguments (rows of the mean length), made without the batch."""
    per_row = 0.0
    for col, size in _columns(topk):
        per_row += 4 + size * (min_len + max_len) / 2 if col.kind == "token" else size
    return int(samples * per_row)


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


def memory() -> dict[str, int]:
    """This process's memory in bytes from /proc/self/status: rss, peak (VmHWM, as ru_maxrss), and the rss
    split into anon (private: a copy would land here), shmem (mapped shared memory) and file."""
    names = {"VmRSS": "rss", "VmHWM": "peak", "RssAnon": "anon", "RssShmem": "shmem", "RssFile": "file"}
    out = {}
    try:
        with open("/proc/self/status") as f:
            for line in f:
                key, _, rest = line.partition(":")
                if key in names:
                    out[names[key]] = int(rest.split()[0]) * 1024
    except OSError:  # not Linux: only the peak
        import resource

        out["peak"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    return out


def _stats(xs: list[float]) -> dict[str, float]:
    return {"median": statistics.median(xs), "min": min(xs), "max": max(xs)}


@dataclass(frozen=True)
class Workload:
    """One `bench store` run's shape: the batch, its writers and readers, the rounds and the fit."""
    samples: int
    min_len: int
    max_len: int
    writers: int = 1
    readers: int = 2
    group_size: int = 8            # rows per put; 0: each writer's rows in one put
    repeats: int = 10
    fit_sizes: tuple[int, ...] = ()  # rows per call of the fit's passes
    fit_repeats: int = 3
    small_repeats: int = 20
    profile: str = ""              # a folder for each worker's cProfile stats
    topk: int = 0                  # a teacher's top-k columns ([L, topk] log-probs and ids) in the workload

    def shards(self) -> list[tuple[int, int]]:
        """Each reader's contiguous rows, as a rank's shard."""
        b = np.linspace(0, self.samples, self.readers + 1).astype(int)
        return [(int(b[i]), int(b[i + 1])) for i in range(self.readers)]

    def groups(self, size: int | None = None) -> list[tuple[int, int]]:
        return group_ranges(self.samples, self.group_size if size is None else size, self.writers)

    def profile_path(self, label: str, role: str) -> str:
        import os

        return os.path.join(self.profile, f"{label}-{role.replace(' ', '')}.prof") if self.profile else ""
