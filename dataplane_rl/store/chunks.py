"""What a stored put is made of: chunk refs, row spans, the raw encoding of a row block, its checksums.

A put is cut into row blocks of about `chunk_bytes` (shm: one block per put); a block holds every column
of the put for its rows as the column's own flat buffers, each 64-byte aligned: a list or string column's
[n+1] int32 offsets (rebased to 0), then its values; a fixed-width column's values (bool: bit-packed, as
Arrow has them). No schema, header or IPC message: the layout follows from the columns' types, the row
count and the bytes of each column (`ChunkRef.sizes`), so a writer copies each column with one call and a
reader wraps each with `pa.Array.from_buffers`, zero-copy.

Checksums (xxh3) are per column, over its region (offsets, then values) in pieces of PIECE bytes: a reader
verifies just the columns it reads and, of those, the pieces holding its offsets and its rows, so a reader
of a row shard of a big put checksums about its share, not the whole put, and a small column is one
checksum. `ChunkRef.checksums` lists them in layout order: per column, one per piece of its region.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass, field
from functools import lru_cache
from typing import Any, Iterable, Mapping, NamedTuple, Sequence

import numpy as np
import pyarrow as pa
import xxhash

from dataplane_rl.schema.types import inner_shape

PID = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}")  # partition ids, fullmatch only: also safe as file and key names
ALIGN = 64  # block offsets inside a put's object or file, so every Arrow buffer stays 64-byte aligned


def align(n: int) -> int:
    return -(-n // ALIGN) * ALIGN


def split_key(key: str) -> tuple[str, int]:
    """A chunk key '<object>@<offset>' -> (object, offset)."""
    obj, _, off = key.rpartition("@")
    return obj, int(off)


# xxh3 of any buffer, zero-copy (the GIL released above 64 KiB); the function itself, no wrapper: it runs per piece
checksum = xxhash.xxh3_64_intdigest


# ---- row sets ----------------------------------------------------------------------------------
def rows_to_spans(rows: np.ndarray) -> list[list[int]]:
    """[0,1,2,5,6] -> [[0,3],[5,7]]: compact, order-preserving encoding of a row list. Vectorised: a
    shard of scattered rows is many runs, and a per-run Python loop cost ~40 us for 64 of them."""
    n = rows.size
    if n == 0:
        return []
    first, last = int(rows[0]), int(rows[-1])
    if last - first == n - 1 and (n == 1 or is_run(rows)):
        return [[first, last + 1]]  # the common case, one run: no per-run bookkeeping
    breaks = np.flatnonzero(np.diff(rows) != 1) + 1  # [S-1]
    starts = np.concatenate([[0], breaks])  # [S]
    ends = np.concatenate([breaks, [n]])  # [S]
    return np.stack([rows[starts], rows[ends - 1] + 1], axis=1).astype(np.int64).tolist()


def is_run(rows: np.ndarray) -> bool:
    """`rows` (at least one) count up by one: a put of a range. Short ones in Python (faster than numpy here)."""
    n, first = rows.size, int(rows[0])
    if int(rows[-1]) - first != n - 1:
        return False
    return rows.tolist() == list(range(first, first + n)) if n <= 64 else bool((rows[1:] - rows[:-1] == 1).all())


def spans_to_rows(spans: Iterable[Sequence[int]]) -> np.ndarray:
    spans = spans if isinstance(spans, list) else list(spans)
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
    bytes of each column in it (values, plus 4 per row for offsets: also what the layout follows from);
    `checksums`: its digests in layout order (see the module doc)."""

    columns: tuple[str, ...]
    rows: np.ndarray = field(compare=False)  # [n] int64
    key: str
    nbytes: int
    checksums: tuple[int, ...]
    sizes: tuple[int, ...] = ()

    def to_json(self) -> dict[str, Any]:
        return {"columns": list(self.columns), "rows": rows_to_spans(self.rows), "key": self.key,
                "nbytes": self.nbytes, "checksums": list(self.checksums), "sizes": list(self.sizes)}

    @classmethod
    def from_json(cls, d: Mapping[str, Any]) -> "ChunkRef":
        return cls._made({"columns": tuple(d["columns"]), "rows": spans_to_rows(d["rows"]), "key": d["key"],
                          "nbytes": int(d["nbytes"]), "checksums": tuple(map(int, d["checksums"])),
                          "sizes": tuple(map(int, d["sizes"]))})

    @classmethod
    def of(cls, block: "Block", key: str, digests: tuple[int, ...]) -> "ChunkRef":
        return cls._made({"columns": block.columns, "rows": block.rows, "key": key, "nbytes": block.nbytes,
                          "checksums": digests, "sizes": block.sizes})

    @classmethod
    def _made(cls, fields: dict[str, Any]) -> "ChunkRef":
        """A ref with all its fields set at once: the frozen dataclass's __init__ sets each through
        object.__setattr__, and a writer makes one per block it puts, a reader one per block of every
        partition it reads."""
        ref = object.__new__(cls)
        object.__setattr__(ref, "__dict__", fields)
        return ref


@lru_cache(maxsize=1024)
def _names_json(columns: tuple[str, ...]) -> str:
    return json.dumps(list(columns))


_PLAIN = re.compile(r"[A-Za-z0-9@/._-]*")  # a key JSON writes as it is (every key this package makes)


def _ref_json(r: ChunkRef) -> str:
    """json.dumps(r.to_json()), the same text, built without the dict and the encoder's walk of it."""
    spans = rows_to_spans(r.rows)
    rows = f"[[{spans[0][0]}, {spans[0][1]}]]" if len(spans) == 1 else \
        "[" + ", ".join([f"[{a}, {b}]" for a, b in spans]) + "]"  # json.dumps' text, without its encoder
    sizes, digests = ", ".join(map(str, r.sizes)), ", ".join(map(str, r.checksums))
    key = f'"{r.key}"' if _PLAIN.fullmatch(r.key) else json.dumps(r.key)
    return (f'{{"columns": {_names_json(r.columns)}, "rows": {rows}, "key": {key}, '
            f'"nbytes": {int(r.nbytes)}, "checksums": [{digests}], "sizes": [{sizes}]}}')


def refs_to_json(refs: Sequence[ChunkRef]) -> str:
    return "[" + ", ".join(map(_ref_json, refs)) + "]"


_scan = json.JSONDecoder().scan_once  # what json.loads runs, without its Python layers (~0.7 us of ~3 a record)


def refs_from_json(text: str | bytes) -> list[ChunkRef]:
    try:
        value, end = _scan(text, 0)
    except (StopIteration, TypeError):  # not JSON, or bytes: json.loads says which, or decodes
        end = -1
    return [ChunkRef.from_json(d) for d in (value if end == len(text) else json.loads(text))]


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
PIECE = 256 << 10  # bytes of a column's values per checksum: a shard reader verifies ~its share of a put


class Part(NamedTuple):
    """One column of a put as flat buffers: `offsets` [n+1] int32 of a list or string column (as the caller's
    array has them: they need not start at 0), and `values` the values of exactly these rows, 1-D, or
    [N, prod(shape)] for a shaped token column (one row of it per token), C-contiguous (bool unpacked, one
    byte per value). `finite`: NaN/inf are refused in it and not yet checked: the write
    checks each piece as it copies it (NotFinite)."""

    offsets: np.ndarray | None
    values: np.ndarray
    finite: bool = False


class NotFinite(Exception):
    """A write found NaN or inf in a column that refuses them (`args[0]`: the column's position)."""


def value_bytes(values: np.ndarray) -> int:
    """Stored bytes of a part's values (bool bit-packed)."""
    return (values.size + 7) >> 3 if values.dtype == np.bool_ else values.nbytes


def part_bytes(part: Part) -> int:
    """A column's bytes as `ChunkRef.sizes` counts them: its values, plus 4 per row for offsets."""
    off = part.offsets
    return value_bytes(part.values) + (4 * (off.size - 1) if off is not None else 0)


@dataclass(frozen=True)
class Block:
    """A row block of a put: `parts` holds each of `columns` for `rows`; `sizes` as `ChunkRef.sizes`,
    `nbytes` the size of its encoding."""

    rows: np.ndarray  # [n] int64
    columns: tuple[str, ...]
    parts: tuple[Part, ...]
    sizes: tuple[int, ...]
    where: tuple  # block_layout's placement of each column
    nbytes: int


@lru_cache(maxsize=4096)
def block_layout(has_offsets: tuple[bool, ...], n: int, sizes: tuple[int, ...]) -> tuple[tuple, int]:
    """Where each column of a block of `n` rows lies: ((offsets at or -1, values at, value bytes, index of
    its first digest), ...) and the block's size. A column's digests cover its region, from its first
    byte (offsets, or values) to its last, in pieces of PIECE bytes: one digest for most columns of a
    small put. A pure function of what a ChunkRef records."""
    at, k, out = 0, 0, []
    for offs, size in zip(has_offsets, sizes):
        if offs:
            o_at, at = at, align(at + 4 * (n + 1))
            vbytes = size - 4 * n
        else:
            o_at, vbytes = -1, size
        out.append((o_at, at, vbytes, k))
        k += -(-(at + vbytes - (o_at if o_at >= 0 else at)) // PIECE)
        at = align(at + vbytes)
    end = out[-1][1] + out[-1][2] if out else 0
    return tuple(out), end


def _region(place: tuple) -> tuple[int, int]:
    """A column's checksummed bytes [start, end) in its block."""
    o_at, v_at, vbytes, _ = place
    return (o_at if o_at >= 0 else v_at), v_at + vbytes


class Columns(NamedTuple):
    """How a block's columns decode: their Arrow types, which have offsets, the bits of one value (of one
    token: a shaped token column's value is its whole [*shape] array), a list column's value type (else
    None) and the inner shape of its tokens (() for a scalar per token). Made once per schema and column
    set (arrow.block_columns)."""

    types: tuple[pa.DataType, ...]
    offsets: tuple[bool, ...]
    bits: tuple[int, ...]
    child: tuple[pa.DataType | None, ...]
    shapes: tuple[tuple[int, ...], ...] = ()

    @classmethod
    def of(cls, types: Sequence[pa.DataType]) -> "Columns":
        lists = [pa.types.is_list(t) for t in types]
        offsets = tuple(lst or pa.types.is_string(t) for t, lst in zip(types, lists))
        shapes, scalars = [], []
        for t, lst in zip(types, lists):
            shape, scalar = inner_shape(t.value_type) if lst else ((), t)
            shapes.append(shape)
            scalars.append(scalar)
        bits = tuple(s.bit_width * math.prod(shape) if lst else 8 if o else s.bit_width
                     for s, shape, lst, o in zip(scalars, shapes, lists, offsets))
        child = tuple(s if lst else None for s, lst in zip(scalars, lists))
        return cls(tuple(types), offsets, bits, child, tuple(shapes))


def token_width(values: np.ndarray) -> int:
    """Values per token of a part's values: 1 for [N], K for [N, K] (a shaped token column, flattened to 2-D)."""
    return values.shape[1] if values.ndim == 2 else 1


def nest(values: pa.Array, shape: Sequence[int]) -> pa.Array:
    """Flat `values` [N * prod(shape)] as N tokens of `shape`: one fixed_size_list level per dimension,
    zero-copy (the values' buffer is the innermost level's)."""
    for d in reversed(tuple(shape)):
        values = pa.FixedSizeListArray.from_arrays(values, int(d))
    return values


def layout(blocks: Sequence[Block]) -> tuple[list[int], int]:
    """Offsets of a put's blocks packed into one object or file, each 64-byte aligned, and its size."""
    offsets, at = [], 0
    for b in blocks:
        offsets.append(at)
        at = align(at + b.nbytes)
    return offsets, (offsets[-1] + blocks[-1].nbytes if blocks else 0)


# ---- block encoding ----------------------------------------------------------------------------
def write_block(dest: np.ndarray, block: Block) -> tuple[int, ...]:
    """Write `block` into `dest` (writable uint8, at least block.nbytes, 64-byte aligned); return its
    checksums, each of the bytes as written. One copy per buffer, no per-row work; a column's values go
    piece by piece, each checksummed (and, for a `finite` part, checked: NotFinite) while it is in cache;
    a column of one piece (most of a GRPO group's) in one step: this runs per column of every put."""
    n = block.rows.size
    digests = []
    for i, (part, (o_at, v_at, vbytes, _)) in enumerate(zip(block.parts, block.where)):
        start = v_at
        if o_at >= 0:
            start = o_at
            src = part.offsets
            o = dest[o_at:o_at + 4 * (n + 1)].view(np.int32)
            first = int(src[0])
            if first:
                np.subtract(src, first, out=o)
            else:
                o[:] = src
        values = part.values
        if values.ndim != 1:  # [N, K] of a shaped column: a view (its values are C-contiguous)
            values = values.reshape(-1)
        if values.dtype == np.bool_:
            values = np.packbits(values, bitorder="little")
        end = v_at + vbytes
        if end - start <= PIECE:  # one piece: the offsets (if any) and all the values
            piece = dest[v_at:end]
            piece[:] = values.view(np.uint8)
            if part.finite and not _finite(piece.view(values.dtype)):
                raise NotFinite(i)
            digests.append(checksum(dest[start:end]))
            continue
        raw = values.view(np.uint8)
        for at in range(start, end, PIECE):
            stop = min(at + PIECE, end)
            a = max(at, v_at)  # the piece's values: it may start with the offsets
            if stop > a:
                piece = dest[a:stop]
                piece[:] = raw[a - v_at:stop - v_at]
                if part.finite and not _finite(piece.view(values.dtype)):
                    raise NotFinite(i)
            digests.append(checksum(dest[at:stop]))
    return tuple(digests)


def _finite(x: np.ndarray) -> bool:
    """v.v is NaN or inf if any value is (or overflows on huge finite values: the exact check decides)."""
    return math.isfinite(np.dot(x, x))


def encode_block(block: Block) -> tuple[pa.Buffer, tuple[int, ...]]:
    """A block as its own buffer, and its checksums (backends that store each block as one object)."""
    out = np.empty(block.nbytes, dtype=np.uint8)
    digests = write_block(out, block)
    return pa.py_buffer(out), digests


class Mismatch(Exception):
    """A stored block's bytes differ from their checksum (`args[0]`: the column)."""


def _verify(data: memoryview, start: int, end: int, digests: tuple[int, ...], k: int, pieces: range,
            column: str) -> None:
    """Check pieces `pieces` of the column region start..end of a block against its digests from `k` on."""
    for p in pieces:
        if checksum(data[start + p * PIECE:min(start + (p + 1) * PIECE, end)]) != digests[k + p]:
            raise Mismatch(column)


def decode_block(payload: pa.Buffer, ref: "ChunkRef", cols: Columns, want: Sequence[int], lo: int, hi: int,
                 whole: bool = False) -> list[pa.Array]:
    """Columns `want` (indices into ref.columns, decoded as `cols` says) of a stored block over its rows
    lo..hi-1 (all its rows if `whole`), zero-copy. Only what rows lo..hi-1 of them hold is checksummed: the
    pieces holding each column's offsets, then those holding the rows' values. Raises Mismatch."""
    n, digests, names = ref.rows.size, ref.checksums, ref.columns
    where, _ = block_layout(cols.offsets, n, ref.sizes)
    data = memoryview(payload)  # slices of it for the checksums: cheaper than numpy's or Arrow's
    first, count = (0, n) if whole else (lo, hi - lo)
    out = []
    for i in want:
        o_at, v_at, vbytes, k = where[i]
        bits, end = cols.bits[i], v_at + vbytes
        start = o_at if o_at >= 0 else v_at
        if o_at >= 0:
            off = data[o_at:o_at + 4 * (n + 1)].cast("i")  # [n+1] (little-endian, as written)
        if end - start <= PIECE:  # one piece (most columns): the offsets' piece, which holds the rows too
            if (o_at >= 0 or hi > lo) and checksum(data[start:end]) != digests[k]:
                raise Mismatch(names[i])
        elif o_at >= 0:
            last = (4 * (n + 1) - 1) // PIECE  # the offsets' last piece: verified before they are used
            _verify(data, start, end, digests, k, range(last + 1), names[i])
            a, b = v_at + (off[lo] * bits >> 3), v_at + (-(-off[hi] * bits // 8) if hi > lo else 0)
            _verify(data, start, end, digests, k, range(max(last + 1, (a - start) // PIECE), -(-(b - start) // PIECE)),
                    names[i])
        else:
            a, b = v_at + (lo * bits >> 3), v_at + (-(-hi * bits // 8))
            _verify(data, start, end, digests, k, range((a - start) // PIECE, -(-(b - start) // PIECE)), names[i])
        values, t, child = payload.slice(v_at, vbytes), cols.types[i], cols.child[i]
        if o_at < 0:
            out.append(pa.Array.from_buffers(t, count, [None, values], 0, first))
        elif child is None:  # string
            out.append(pa.Array.from_buffers(t, count, [None, payload.slice(o_at, 4 * (n + 1)), values], 0, first))
        else:
            shape = cols.shapes[i] if cols.shapes else ()
            child = pa.Array.from_buffers(child, off[n] * math.prod(shape) if shape else off[n], [None, values])
            out.append(pa.Array.from_buffers(t, count, [None, payload.slice(o_at, 4 * (n + 1))], 0, first,
                                             [nest(child, shape) if shape else child]))
    return out
