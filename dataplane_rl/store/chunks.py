"""What a stored put is made of: chunk refs, row spans, the IPC encoding of a row block, its checksum.

A put is cut into row blocks of about `chunk_bytes`; each block is ONE Arrow IPC record-batch message
holding every column of the put for those rows, checksummed with xxh3. The message carries no schema: a
reader decodes it against the partition's schema (decoded once per partition), so a block costs one
validation pass, one copy and one checksum on write, and one checksum and a zero-copy wrap on read.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from functools import lru_cache
from typing import Any, Iterable, Mapping, NamedTuple, Sequence

import numpy as np
import pyarrow as pa
import xxhash

PID = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}")  # partition ids, fullmatch only: also safe as file and key names
ALIGN = 64  # block offsets inside a put's object or file, so every Arrow buffer stays 64-byte aligned
_IPC_OPTIONS = pa.ipc.IpcWriteOptions()  # explicit: the default re-reads two env vars per stream
EOS = _EOS = 8  # the end-of-stream marker a stream writer adds on close


def align(n: int) -> int:
    return -(-n // ALIGN) * ALIGN


def split_key(key: str) -> tuple[str, int]:
    """A chunk key '<object>@<offset>' -> (object, offset)."""
    obj, _, off = key.rpartition("@")
    return obj, int(off)


def checksum(buf) -> int:
    return xxhash.xxh3_64_intdigest(buf)


# ---- row sets ----------------------------------------------------------------------------------
def rows_to_spans(rows: np.ndarray) -> list[list[int]]:
    """[0,1,2,5,6] -> [[0,3],[5,7]]: compact, order-preserving encoding of a row list. Vectorised: a
    shard of scattered rows is many runs, and a per-run Python loop cost ~40 us for 64 of them."""
    n = rows.size
    if n == 0:
        return []
    first, last = int(rows[0]), int(rows[-1])
    if last - first == n - 1 and (n == 1 or bool((rows[1:] - rows[:-1] == 1).all())):
        return [[first, last + 1]]  # the common case, one run: no per-run bookkeeping
    breaks = np.flatnonzero(np.diff(rows) != 1) + 1  # [S-1]
    starts = np.concatenate([[0], breaks])  # [S]
    ends = np.concatenate([breaks, [n]])  # [S]
    return np.stack([rows[starts], rows[ends - 1] + 1], axis=1).astype(np.int64).tolist()


def spans_to_rows(spans: Iterable[Sequence[int]]) -> np.ndarray:
    spans = list(spans)
    if len(spans) == 1:
        return np.arange(spans[0][0], spans[0][1], dtype=np.int64)
    if not spans:
        return np.zeros(0, dtype=np.int64)
    bounds = np.array(spans, dtype=np.int64).reshape(len(spans), 2)  # [S, 2]
    lens = np.maximum(bounds[:, 1] - bounds[:, 0], 0)  # [S] (an empty span adds no rows, as arange did)
    # row k of span s is start_s + (k - rows before s): one arange and one repeat, no array per span
    before = np.cumsum(lens) - lens  # [S]
    return np.arange(int(lens.sum()), dtype=np.int64) + np.repeat(bounds[:, 0] - before, lens)


# ---- catalog records ---------------------------------------------------------------------------
@dataclass(frozen=True)
class ChunkRef:
    """A committed row block: `columns` for `rows` (in stored order), held under `key`; `sizes`: the
    bytes of each column's values in it (for status)."""

    columns: tuple[str, ...]
    rows: np.ndarray = field(compare=False)  # [n] int64
    key: str
    nbytes: int
    checksum: int
    sizes: tuple[int, ...] = ()

    def to_json(self) -> dict[str, Any]:
        return {"columns": list(self.columns), "rows": rows_to_spans(self.rows), "key": self.key,
                "nbytes": self.nbytes, "checksum": self.checksum, "sizes": list(self.sizes)}

    @classmethod
    def from_json(cls, d: Mapping[str, Any]) -> "ChunkRef":
        return cls(tuple(d["columns"]), spans_to_rows(d["rows"]), d["key"], int(d["nbytes"]), int(d["checksum"]),
                   tuple(int(n) for n in d["sizes"]))

    @classmethod
    def of(cls, block: "Block", key: str, digest: int) -> "ChunkRef":
        return cls(block.columns, block.rows, key, block.nbytes, digest, block.sizes)


@lru_cache(maxsize=1024)
def _names_json(columns: tuple[str, ...]) -> str:
    return json.dumps(list(columns))


def _ref_json(r: ChunkRef) -> str:
    """json.dumps(r.to_json()), the same text, built without the dict and the encoder's walk of it."""
    spans = rows_to_spans(r.rows)
    rows = f"[[{spans[0][0]}, {spans[0][1]}]]" if len(spans) == 1 else \
        "[" + ", ".join([f"[{a}, {b}]" for a, b in spans]) + "]"  # json.dumps' text, without its encoder
    sizes = ", ".join(map(str, r.sizes))
    return (f'{{"columns": {_names_json(r.columns)}, "rows": {rows}, "key": {json.dumps(r.key)}, '
            f'"nbytes": {int(r.nbytes)}, "checksum": {int(r.checksum)}, "sizes": [{sizes}]}}')


def refs_to_json(refs: Sequence[ChunkRef]) -> str:
    return "[" + ", ".join(map(_ref_json, refs)) + "]"


def refs_from_json(text: str | bytes) -> list[ChunkRef]:
    return [ChunkRef.from_json(d) for d in json.loads(text)]


@dataclass(frozen=True)
class PartitionMeta:
    """What create_partition records: the id, the full schema (so any process can validate) and the size.
    `token` is the backend's name for this incarnation of the id (a dropped and re-made partition gets a
    new one); it is not stored in the meta's JSON."""

    pid: str
    schema_json: str
    num_rows: int
    token: str = ""

    def to_json(self) -> str:
        return json.dumps({"pid": self.pid, "schema": json.loads(self.schema_json), "num_rows": self.num_rows})

    @classmethod
    def from_json(cls, text: str, token: str = "") -> "PartitionMeta":
        d = json.loads(text)
        return cls(d["pid"], json.dumps(d["schema"]), int(d["num_rows"]), token)


class Snapshot(NamedTuple):
    """A partition as one catalog read saw it: its meta and its committed refs, in commit order."""

    meta: PartitionMeta
    refs: list[ChunkRef]


# ---- blocks ------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Block:
    """A row block of a put: `batch` holds every column of the put for `rows`; `nbytes` is the size of
    its record-batch message, `sizes` the bytes of each column's values in it."""

    rows: np.ndarray  # [n] int64
    batch: pa.RecordBatch
    columns: tuple[str, ...]
    nbytes: int
    sizes: tuple[int, ...]


def offsets_view(arr: pa.Array) -> np.ndarray:
    """The [n+1] int32 offsets of a list or string array's rows, a view of its offsets buffer (no offsets
    array or scalars made)."""
    n = len(arr)
    if not n:
        return np.zeros(1, dtype=np.int32)
    return np.frombuffer(arr.buffers()[1], dtype=np.int32, count=n + 1, offset=4 * arr.offset)


def _offsets(arr: pa.Array) -> tuple[np.ndarray | None, float]:
    """(the offsets of a list or string column, or None for a fixed-width one; the bytes of one value)."""
    t = arr.type
    if pa.types.is_list(t) or pa.types.is_string(t):
        return offsets_view(arr), (t.value_type.bit_width / 8 if pa.types.is_list(t) else 1)
    return None, t.bit_width / 8


def _column_bytes(arr: pa.Array) -> int:
    """The bytes of a column's values, with 4 per row for the offsets of a list or string column."""
    offsets, width = _offsets(arr)
    n = len(arr)
    if offsets is not None:
        return int((int(offsets[n]) - int(offsets[0])) * width) + 4 * n
    return round(n * width)


def make_blocks(rows: np.ndarray, batch: pa.RecordBatch, limit: int, names: tuple[str, ...] | None = None,
                columns: Sequence[pa.Array] | None = None, whole: Sequence[int] | None = None) -> list[Block]:
    """Cut a put into row blocks of about `limit` bytes each (at least one block, split by bytes, not
    rows, so long rows do not make one block huge). `names`, `columns` and `whole` (each column's
    bytes): the batch's, if the caller holds them already (each access to batch.schema or batch.columns
    builds new wrappers)."""
    n = batch.num_rows
    names = names or tuple(batch.schema.names)
    if not n:
        return [Block(rows, batch, names, pa.ipc.get_record_batch_size(batch), (0,) * len(names))]
    columns = columns or batch.columns
    whole = whole or [_column_bytes(c) for c in columns]
    if sum(whole) <= limit:  # one block: no per-row sizes needed
        return [Block(rows, batch, names, pa.ipc.get_record_batch_size(batch), tuple(whole))]
    # cum[r]: the bytes of rows 0..r-1, from each column's offsets (no per-row array per column)
    r = np.arange(n + 1, dtype=np.float64)  # [n+1]
    info = [_offsets(c) for c in columns]
    fixed = sum(w for off, w in info if off is None)
    cum = r * (fixed + 4 * sum(1 for off, _ in info if off is not None))  # [n+1]
    for off, w in info:
        if off is not None:
            cum += (off - off[0]) * w
    total = float(cum[-1])
    k = max(1, min(n, int(-(-total // limit))))
    cuts = np.searchsorted(cum[1:], total * np.arange(1, k) / k, side="right").tolist() if k > 1 else []
    bounds = sorted({0, n, *cuts})
    out = []
    for lo, hi in zip(bounds[:-1], bounds[1:]):
        size = tuple(round((hi - lo) * w) if off is None else int((int(off[hi]) - int(off[lo])) * w) + 4 * (hi - lo)
                     for off, w in info)
        part = batch.slice(lo, hi - lo)
        out.append(Block(rows[lo:hi], part, names, pa.ipc.get_record_batch_size(part), size))
    return out


# ---- block encoding ----------------------------------------------------------------------------
@lru_cache(maxsize=1024)
def head_bytes(schema: pa.Schema) -> int:
    """Size of the schema message a stream writer puts before the first batch."""
    mock = pa.MockOutputStream()
    pa.ipc.new_stream(mock, schema, options=_IPC_OPTIONS).close()
    return mock.size() - _EOS


def room(block: Block) -> int:
    """Bytes `write_block` touches from the block's offset on (the message and the writer's end marker)."""
    return block.nbytes + _EOS


def write_block(sink, batch: pa.RecordBatch) -> None:
    """Write `batch`'s record-batch message to `sink`, which must stand `head_bytes(batch.schema)` before
    the block's offset: pyarrow writes a batch message only inside a stream, so the stream's schema
    message goes to the bytes just before the block (the previous block's end marker and padding, or
    the head room of the object) and is never read."""
    with pa.ipc.new_stream(sink, batch.schema, options=_IPC_OPTIONS) as writer:
        writer.write_batch(batch)


def layout(blocks: Sequence[Block], head: int) -> tuple[list[int], int]:
    """Offsets of a put's blocks (all of one schema, whose stream head is `head` bytes) packed into one
    object or file, and its size. Each block's message starts 64-byte aligned, with room for its stream
    head just before it; a block's head may overwrite the previous block's end marker, never its message."""
    if not blocks:
        return [], 0
    offsets, at = [], align(head)
    for b in blocks:
        offsets.append(at)
        at = align(at + b.nbytes + head)
    return offsets, offsets[-1] + room(blocks[-1])


def encode_block(batch: pa.RecordBatch) -> pa.Buffer:
    """A block as its own buffer (backends that store each block as one object)."""
    sink = pa.BufferOutputStream()
    write_block(sink, batch)
    data = sink.getvalue()
    return data.slice(head_bytes(batch.schema), pa.ipc.get_record_batch_size(batch))


def decode_block(buf: pa.Buffer, schema: pa.Schema) -> pa.RecordBatch:
    return pa.ipc.read_record_batch(buf, schema)
