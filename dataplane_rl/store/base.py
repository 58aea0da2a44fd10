"""The column-store semantics every backend shares (DESIGN §4).

`ColumnStore` implements the public API once: validation against the declared schema, row identity,
write-once cells, all-or-nothing puts, missing-cell errors and checksummed chunks. A backend supplies
only storage: a catalog of partitions and committed chunk references, and a place for chunk bytes.

A put becomes one chunk per column and block of rows (`chunk_bytes`): an Arrow IPC stream of that column
for those rows, stored under a fresh unique key, with its xxh3 checksum in the chunk reference. Bytes are
stored first and the references committed last, in one atomic step that re-checks that no cell is already
written, so a failed or concurrent put never leaves a half-written partition.
"""

from __future__ import annotations

import json
import re
import time
import uuid
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Any, Iterable, Mapping, Sequence

import numpy as np
import pyarrow as pa
import xxhash

from dataplane_rl.errors import (
    AlignmentError,
    CorruptChunkError,
    DuplicateWriteError,
    MissingColumnError,
    PartitionNotFoundError,
    SchemaError,
    StoreTimeoutError,
    StoreUnavailableError,
    format_rows,
)
from dataplane_rl.schema import Column, Schema, load_schema
from dataplane_rl.store.tensors import list_array

_PID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")
# Rows per partition: a read keeps two int64 arrays of num_rows, so more would be gigabytes of bookkeeping
MAX_ROWS = 1 << 26


# ---- row sets ----------------------------------------------------------------------------------
def rows_to_spans(rows: np.ndarray) -> list[list[int]]:
    """[0,1,2,5,6] -> [[0,3],[5,7]]: compact, order-preserving encoding of a row list."""
    n = rows.size
    if n == 0:
        return []
    first, last = int(rows[0]), int(rows[-1])
    if last - first == n - 1 and (n == 1 or bool((rows[1:] - rows[:-1] == 1).all())):
        return [[first, last + 1]]  # the common case, one run: no per-run bookkeeping
    breaks = np.flatnonzero(np.diff(rows) != 1) + 1
    starts = np.concatenate([[0], breaks])
    ends = np.concatenate([breaks, [rows.size]])
    return [[int(rows[s]), int(rows[e - 1]) + 1] for s, e in zip(starts, ends)]


def spans_to_rows(spans: Iterable[Sequence[int]]) -> np.ndarray:
    parts = [np.arange(a, b, dtype=np.int64) for a, b in spans]
    return np.concatenate(parts) if parts else np.zeros(0, dtype=np.int64)


@dataclass(frozen=True)
class ChunkRef:
    """A committed chunk: `column` values for `rows` (in stored order), held under `key`."""

    column: str
    rows: np.ndarray = field(compare=False)  # [n] int64
    key: str
    nbytes: int
    checksum: int

    def to_json(self) -> dict[str, Any]:
        return {"column": self.column, "rows": rows_to_spans(self.rows), "key": self.key,
                "nbytes": self.nbytes, "checksum": self.checksum}

    @classmethod
    def from_json(cls, d: Mapping[str, Any]) -> "ChunkRef":
        return cls(d["column"], spans_to_rows(d["rows"]), d["key"], int(d["nbytes"]), int(d["checksum"]))


@dataclass(frozen=True)
class PartitionMeta:
    """What create_partition records: the id, the full schema (so any process can validate) and the size."""

    pid: str
    schema_json: str
    num_rows: int

    def to_json(self) -> str:
        return json.dumps({"pid": self.pid, "schema": json.loads(self.schema_json), "num_rows": self.num_rows})

    @classmethod
    def from_json(cls, text: str) -> "PartitionMeta":
        d = json.loads(text)
        return cls(d["pid"], json.dumps(d["schema"]), int(d["num_rows"]))


@dataclass
class PartitionStatus:
    """Rows written per column (of num_rows) and stored bytes per column."""

    pid: str
    schema: str
    num_rows: int
    rows_written: dict[str, int]
    nbytes: dict[str, int]

    @property
    def total_bytes(self) -> int:
        return sum(self.nbytes.values())

    def complete(self, fields: Iterable[str]) -> bool:
        return all(self.rows_written.get(f, 0) == self.num_rows for f in fields)


_SCHEMA_CACHE: dict[str, Schema] = {}


def schema_of(meta: PartitionMeta) -> Schema:
    s = _SCHEMA_CACHE.get(meta.schema_json)
    if s is None:
        s = _SCHEMA_CACHE[meta.schema_json] = Schema.model_validate_json(meta.schema_json)
    return s


# ---- chunk encoding ----------------------------------------------------------------------------
def encode_chunk(name: str, array: pa.Array) -> pa.Buffer:
    """One column as an Arrow IPC stream: self-describing, and readable without a copy."""
    batch = pa.record_batch([array], names=[name])
    sink = pa.BufferOutputStream()
    with pa.ipc.new_stream(sink, batch.schema) as writer:
        writer.write_batch(batch)
    return sink.getvalue()


def decode_chunk(buf) -> pa.Array:
    reader = pa.ipc.open_stream(pa.py_buffer(buf) if not isinstance(buf, pa.Buffer) else buf)
    batch = reader.read_next_batch()
    return batch.column(0)


def checksum(buf) -> int:
    return xxhash.xxh3_64_intdigest(buf)


# ---- input coercion ----------------------------------------------------------------------------
def _to_numpy(data: Any) -> np.ndarray:
    if hasattr(data, "detach") and hasattr(data, "cpu"):  # torch.Tensor, without importing torch
        data = data.detach().cpu().numpy()
    return np.asarray(data)


def to_arrow(col: Column, data: Any, where: str) -> pa.Array:
    """Coerce user data to the column's declared Arrow type, refusing silent casts.

    Accepts Arrow arrays, numpy arrays or torch tensors (sample columns), lists of strings, and for
    token columns an Arrow list array or a sequence of 1-D arrays/tensors (one per row).
    """
    want = col.arrow_type
    if isinstance(data, pa.ChunkedArray):
        data = data.combine_chunks()
    if isinstance(data, pa.Array):
        if data.type != want:
            raise SchemaError(f"{where} column '{col.name}' has Arrow type {data.type}, declared {want}; "
                              f"cast it with .cast(pa.{want}) only if the values fit")
        return data
    if col.kind == "token":
        if isinstance(data, np.ndarray) and data.dtype != object:
            raise SchemaError(f"{where} token column '{col.name}' given as a {data.ndim}-D array; pass one 1-D "
                              "array per row (a list) or a pyarrow ListArray, so each row keeps its own length")
        parts = [_to_numpy(x) for x in data]
        for i, p in enumerate(parts):
            if p.ndim != 1:
                raise SchemaError(f"{where} token column '{col.name}' row #{i} is {p.ndim}-D; each row must be 1-D")
        values = np.concatenate(parts) if parts else np.zeros(0, dtype=col.value_type.to_pandas_dtype())
        _check_np_dtype(col, values, where)
        return list_array(values, [p.size for p in parts], col.value_type)
    if col.dtype == "string":
        values = list(data)
        if not all(isinstance(v, str) for v in values):
            raise SchemaError(f"{where} string column '{col.name}' holds a non-str value; pass a list of str")
        return pa.array(values, type=pa.string())
    arr = _to_numpy(data)
    if arr.ndim != 1:
        raise SchemaError(f"{where} sample column '{col.name}' has shape {arr.shape}; a sample column is 1-D "
                          "(one value per row)")
    _check_np_dtype(col, arr, where)
    return pa.array(arr, type=col.value_type)


def _check_np_dtype(col: Column, arr: np.ndarray, where: str) -> None:
    want = np.dtype(col.value_type.to_pandas_dtype())
    if arr.dtype != want:
        raise SchemaError(f"{where} column '{col.name}' has dtype {arr.dtype}, declared {col.dtype}; "
                          f"convert it first (e.g. .astype(np.{want}))")


# ---- the store ---------------------------------------------------------------------------------
class ColumnStore(ABC):
    """A partitioned, write-once column store. Subclasses implement the `_`-prefixed storage hooks."""

    scheme: str = ""
    # A put's column is stored as row blocks of about this many bytes, so a reader of a shard checksums
    # only the blocks holding its rows, not the whole put once per reader.
    chunk_bytes: int = 4 << 20

    def __init__(self) -> None:
        self._closed = False

    # -- backend hooks ---------------------------------------------------------------------------
    @property
    @abstractmethod
    def url(self) -> str:
        """A URL another process can pass to open_store to reach the same data."""

    @abstractmethod
    def _create(self, meta: PartitionMeta) -> None:
        """Record a new partition; raise PartitionExistsError if the id is taken."""

    @abstractmethod
    def _meta(self, pid: str) -> PartitionMeta:
        """The partition's meta; raise PartitionNotFoundError if unknown or dropped."""

    @abstractmethod
    def _chunks(self, pid: str) -> list[ChunkRef]:
        """The committed chunks of a partition."""

    @abstractmethod
    def _write_chunks(self, pid: str, chunks: list[tuple[ChunkRef, pa.Buffer]]) -> list[tuple[ChunkRef, Any]] | None:
        """Store chunk bytes under their keys. Not visible to readers until committed.

        A backend that stores the bytes only here (e.g. all chunks of a put in one object) may return
        the chunks with their final refs (same columns and rows, in order; keys and checksums may be
        set here); then it must remove whatever it stored itself if it raises."""

    @abstractmethod
    def _commit(self, pid: str, refs: list[ChunkRef]) -> None:
        """Atomically make refs visible, after checking under the catalog's lock that none of their
        cells is already committed (raise DuplicateWriteError via `self._duplicate_error`)."""

    @abstractmethod
    def _discard(self, pid: str, refs: list[ChunkRef]) -> None:
        """Delete uncommitted chunk bytes after a failed put. Must not raise."""

    @abstractmethod
    def _read_chunks(self, pid: str, refs: list[ChunkRef]) -> list[Any]:
        """The bytes of each ref (bytes, memoryview or pa.Buffer), in order."""

    @abstractmethod
    def _drop(self, pid: str) -> None:
        """Forget the partition and free its chunks; raise PartitionNotFoundError if unknown."""

    @abstractmethod
    def _list(self) -> list[str]:
        """Ids of live partitions."""

    def _close(self) -> None:
        """Release backend resources."""

    def _encode(self, pid: str, name: str, array: pa.Array, rows: np.ndarray) -> tuple[ChunkRef, Any]:
        """One column of a put as (ref, payload for `_write_chunks`). A backend may override this to
        serialize straight into its storage (then the payload may be None); whatever it stored must be
        removable by `_discard(pid, [ref])`, and it must clean up itself if it raises."""
        buf = encode_chunk(name, array)
        return ChunkRef(name, rows, f"{pid}/{name}/{uuid.uuid4().hex}", buf.size, checksum(buf)), buf

    # -- public API ------------------------------------------------------------------------------
    def create_partition(self, pid: str, schema: str | Schema = "grpo", num_rows: int = 0) -> None:
        """Create partition `pid` of `num_rows` rows following `schema` (a name, path or Schema)."""
        self._check_open()
        if not isinstance(pid, str) or not _PID.match(pid):
            raise SchemaError(f"partition id {pid!r} is invalid; use 1-128 characters of letters, digits, '.', '_', '-'")
        if isinstance(num_rows, bool) or not isinstance(num_rows, (int, np.integer)) or not 0 <= num_rows <= MAX_ROWS:
            raise SchemaError(f"partition {pid}: num_rows={num_rows!r} must be an integer from 0 to at most "
                              f"{MAX_ROWS}; split larger batches over several partitions")
        s = load_schema(schema)
        self._create(PartitionMeta(pid, s.model_dump_json(), int(num_rows)))

    def put(self, pid: str, columns: Mapping[str, Any], rows: Any) -> None:
        """Write `columns` for `rows` (indices or a range). All or nothing; every cell once."""
        self._check_open()
        meta = self._meta(self._check_pid(pid))
        schema = schema_of(meta)
        rows = self._rows(pid, meta, rows, unique=True)
        where = f"partition {pid} put rows {_rows_text(rows)}:"
        if not isinstance(columns, Mapping):
            raise SchemaError(f"{where} columns must be a mapping {{column name: data}}, got {type(columns).__name__}")
        if not columns:
            raise SchemaError(f"{where} no columns given; pass {{column: data}}")
        arrays = {}
        for name, data in columns.items():
            if not isinstance(name, str) or name not in schema.by_name:
                try:
                    schema.column(name if isinstance(name, str) else repr(name))
                except SchemaError as e:  # name the partition and rows too
                    raise SchemaError(f"{where} {e}") from None
            arrays[name] = to_arrow(schema.by_name[name], data, where)
        bad = {k: len(a) for k, a in arrays.items() if len(a) != len(rows)}
        if bad:
            desc = ", ".join(f"'{k}' has {n}" for k, n in bad.items())
            raise AlignmentError(f"{where} {desc} values for {len(rows)} rows; every column in one put must "
                                 "cover exactly the given rows")
        lengths = None
        if any(schema.by_name[n].kind == "token" for n in arrays) and schema.length_column not in arrays:
            lengths = self._stored_lengths(pid, meta, rows, [n for n in arrays if schema.by_name[n].kind == "token"])
        schema.check(arrays, lengths, where=where[:-1], rows=rows)
        committed = self._chunks(pid)
        for name in arrays:
            self._raise_if_written(pid, meta, committed, name, rows)
        chunks: list[tuple[ChunkRef, Any]] = []
        try:
            for name, arr in arrays.items():
                for lo, hi in _row_blocks(arr, self.chunk_bytes):
                    chunks.append(self._encode(pid, name, arr.slice(lo, hi - lo), rows[lo:hi]))
            final = self._write_chunks(pid, chunks)
            if final is not None:
                same = [(r.column, len(r.rows)) for r, _ in final] == [(r.column, len(r.rows)) for r, _ in chunks]
                chunks = final  # discarded below if anything fails from here
                if not same:
                    raise RuntimeError(f"{type(self).__name__}._write_chunks returned refs of other chunks")
            self._commit(pid, [r for r, _ in chunks])
        except BaseException:
            self._discard(pid, [r for r, _ in chunks])
            raise

    def get(self, pid: str, fields: str | Sequence[str], rows: Any = None) -> pa.Table:
        """The requested fields for `rows` (default all), in the requested row order, as an Arrow table."""
        self._check_open()
        meta = self._meta(self._check_pid(pid))
        schema = schema_of(meta)
        if isinstance(fields, str):
            fields = [fields]
        elif not isinstance(fields, (list, tuple)) or not all(isinstance(f, str) for f in fields):
            raise SchemaError(f"partition {pid} get: fields must be a column name or a list of names, got {fields!r}")
        fields = list(fields)
        if not fields:
            raise SchemaError(f"partition {pid} get: no fields requested")
        for f in fields:
            schema.column(f)
        if len(set(fields)) != len(fields):
            raise SchemaError(f"partition {pid} get: a field is requested twice in {fields}")
        rows = self._rows(pid, meta, rows, unique=False)
        committed = self._chunks(pid)
        plans = {}
        for f in fields:
            plans[f] = self._plan(pid, meta, committed, f, rows)
        needed = list({id(ref): ref for plan in plans.values() for ref in plan[0]}.values())
        payloads = dict(zip((r.key for r in needed), self._read_chunks(pid, needed))) if needed else {}
        decoded = {r.key: self._decode(pid, r, payloads[r.key]) for r in needed}
        out = []
        for f in fields:
            refs, owner, pos = plans[f]
            out.append(_gather([decoded[r.key] for r in refs], owner, pos, rows, schema.by_name[f].arrow_type))
        return pa.Table.from_arrays(out, schema=schema.arrow_schema(fields))

    def status(self, pid: str) -> PartitionStatus:
        self._check_open()
        meta = self._meta(self._check_pid(pid))
        schema = schema_of(meta)
        written = {c: 0 for c in schema.names}
        nbytes = {c: 0 for c in schema.names}
        for ref in self._chunks(pid):
            written[ref.column] += len(ref.rows)
            nbytes[ref.column] += ref.nbytes
        return PartitionStatus(pid, schema.name, meta.num_rows, written, nbytes)

    def ready(self, pid: str, fields: str | Sequence[str]) -> np.ndarray:
        """The rows (sorted int64) on which every named field is written. Reads the catalog, never data."""
        self._check_open()
        meta = self._meta(self._check_pid(pid))
        fields = self._field_list(pid, meta, fields, "ready")
        written = np.zeros((len(fields), meta.num_rows), dtype=bool)
        index = {f: i for i, f in enumerate(fields)}
        for ref in self._chunks(pid):
            i = index.get(ref.column)
            if i is not None:
                written[i, ref.rows] = True
        return np.flatnonzero(written.all(axis=0)).astype(np.int64)

    def wait(self, pid: str, fields: str | Sequence[str], rows: Any = None, timeout: float = 60.0) -> np.ndarray:
        """Block until every named field is written on `rows` (default all); return those rows.

        Raises StoreTimeoutError after `timeout` seconds naming the rows and fields still missing, and
        PartitionNotFoundError at once if the partition does not exist (or is dropped while waiting)."""
        self._check_open()
        meta = self._meta(self._check_pid(pid))
        fields = self._field_list(pid, meta, fields, "wait")
        want = self._rows(pid, meta, rows, unique=False)
        deadline = time.monotonic() + timeout
        pause = 0.0005
        while True:
            missing = {}
            for f in fields:
                lack = np.setdiff1d(want, self.ready(pid, [f]), assume_unique=False)
                if lack.size:
                    missing[f] = lack
            if not missing:
                return want
            left = deadline - time.monotonic()
            if left <= 0:
                detail = "; ".join(f"{f}: rows {format_rows(r)}" for f, r in missing.items())
                raise StoreTimeoutError(f"partition {pid}: waited {timeout:g} s and these cells are still unwritten: "
                                        f"{detail}; check that the writer is alive, or raise the timeout")
            # back off from 0.5 ms to 20 ms: a catalog read per wake-up, no spinning
            time.sleep(min(pause, left))
            pause = min(pause * 2, 0.02)

    def _field_list(self, pid: str, meta: PartitionMeta, fields: Any, what: str) -> list[str]:
        schema = schema_of(meta)
        if isinstance(fields, str):
            fields = [fields]
        elif not isinstance(fields, (list, tuple)) or not all(isinstance(f, str) for f in fields) or not fields:
            raise SchemaError(f"partition {pid} {what}: fields must be a column name or a non-empty list of names, "
                              f"got {fields!r}")
        for f in fields:
            schema.column(f)
        return list(fields)

    def list_partitions(self) -> list[str]:
        self._check_open()
        return sorted(self._list())

    def drop_partition(self, pid: str) -> None:
        self._check_open()
        self._drop(self._check_pid(pid))

    def schema(self, pid: str) -> Schema:
        """The schema partition `pid` was created with."""
        self._check_open()
        return schema_of(self._meta(self._check_pid(pid)))

    def num_rows(self, pid: str) -> int:
        self._check_open()
        return self._meta(self._check_pid(pid)).num_rows

    def close(self) -> None:
        if not self._closed:
            self._closed = True
            self._close()

    def __enter__(self) -> "ColumnStore":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.url!r})"

    # -- shared helpers --------------------------------------------------------------------------
    def _check_open(self) -> None:
        if self._closed:
            raise StoreUnavailableError(f"store {self.url} is closed; open a new one with open_store")

    def _check_pid(self, pid: Any) -> str:
        if not isinstance(pid, str) or not _PID.match(pid):
            raise PartitionNotFoundError(f"partition {pid!r} is unknown in {self.url}: a partition id is 1-128 "
                                         "letters, digits, '.', '_', '-'")
        return pid

    def _rows(self, pid: str, meta: PartitionMeta, rows: Any, *, unique: bool) -> np.ndarray:
        n = meta.num_rows
        if rows is None:
            return np.arange(n, dtype=np.int64)
        if isinstance(rows, slice):
            try:
                rows = range(*rows.indices(n))
            except (TypeError, ValueError) as e:
                raise AlignmentError(f"partition {pid}: rows slice {rows} is not a slice of integers ({e})") from None
        if isinstance(rows, range):
            # checked on the ends, before any row list is made: range(10**18) must not allocate
            if rows and (min(rows[0], rows[-1]) < 0 or max(rows[0], rows[-1]) >= n):
                raise AlignmentError(f"partition {pid}: rows {rows.start}-{rows.stop - 1} (step {rows.step}) out of "
                                     f"range; the partition has {n} rows (0-{n - 1})")
            out = np.arange(rows.start, rows.stop, rows.step, dtype=np.int64)
        else:
            try:
                arr = _to_numpy(rows)
            except (TypeError, ValueError, OverflowError) as e:
                raise AlignmentError(f"partition {pid}: rows must be a range or 1-D integer indices ({e})") from None
            if arr.ndim != 1 or (arr.size and not np.issubdtype(arr.dtype, np.integer)):
                raise AlignmentError(f"partition {pid}: rows must be a range or 1-D integer indices, got {arr.dtype} "
                                     f"shape {arr.shape}")
            out = arr.astype(np.int64, copy=False)
        bad = out[(out < 0) | (out >= n)]
        if bad.size:
            raise AlignmentError(f"partition {pid}: rows {format_rows(bad)} out of range; the partition has {n} rows")
        if unique and np.unique(out).size != out.size:
            vals, counts = np.unique(out, return_counts=True)
            raise AlignmentError(f"partition {pid}: rows {format_rows(vals[counts > 1])} given more than once in one put")
        return out

    @staticmethod
    def _owners(meta: PartitionMeta, refs: list[ChunkRef]) -> tuple[np.ndarray, np.ndarray]:
        """For each row: index into refs of the chunk holding it (-1: unwritten) and its position there."""
        owner = np.full(meta.num_rows, -1, dtype=np.int64)
        pos = np.zeros(meta.num_rows, dtype=np.int64)
        for i, ref in enumerate(refs):
            owner[ref.rows] = i
            pos[ref.rows] = np.arange(len(ref.rows))
        return owner, pos

    def _raise_if_written(self, pid, meta, committed, name, rows) -> None:
        refs = [r for r in committed if r.column == name]
        if not refs:
            return
        owner, _ = self._owners(meta, refs)
        hit = rows[owner[rows] >= 0]
        if hit.size:
            raise self._duplicate_error(pid, meta, name, hit)

    @staticmethod
    def _duplicate_error(pid: str, meta: PartitionMeta, name: str, rows: np.ndarray) -> DuplicateWriteError:
        writer = schema_of(meta).by_name[name].writer
        return DuplicateWriteError(f"partition {pid} column '{name}' rows {format_rows(rows)} already written "
                                   f"(writer: {writer}); cells are written once, write a new partition instead")

    def _conflicts(self, meta: PartitionMeta, committed: list[ChunkRef], refs: list[ChunkRef]) -> DuplicateWriteError | None:
        """For `_commit`: the error for the first ref overlapping committed cells, or None."""
        for ref in refs:
            same = [r for r in committed if r.column == ref.column]
            if same:
                owner, _ = self._owners(meta, same)
                hit = ref.rows[owner[ref.rows] >= 0]
                if hit.size:
                    return self._duplicate_error(meta.pid, meta, ref.column, hit)
        return None

    def _plan(self, pid, meta, committed, name, rows):
        refs = [r for r in committed if r.column == name]
        owner, pos = self._owners(meta, refs)
        missing = rows[owner[rows] < 0]
        if missing.size:
            writer = schema_of(meta).by_name[name].writer
            raise MissingColumnError(f"partition {pid} column '{name}' rows {format_rows(missing)} not written "
                                     f"(writer: {writer})")
        used = np.unique(owner[rows])
        remap = np.full(len(refs), -1, dtype=np.int64)
        remap[used] = np.arange(used.size)
        return [refs[i] for i in used], remap[owner], pos

    def _stored_lengths(self, pid, meta, rows, token_cols) -> np.ndarray:
        length_col = schema_of(meta).length_column
        try:
            table = self.get(pid, [length_col], rows)
        except MissingColumnError as e:
            raise MissingColumnError(f"{e}; token column(s) {token_cols} are checked against {length_col}, "
                                     f"so write {length_col} first or in the same put") from None
        return table.column(0).to_numpy().astype(np.int64)

    def _decode(self, pid: str, ref: ChunkRef, payload: Any) -> pa.Array:
        size = len(payload) if not isinstance(payload, pa.Buffer) else payload.size
        if size != ref.nbytes or checksum(payload) != ref.checksum:
            what = "missing (evicted or lost)" if size == 0 else f"corrupt ({size} bytes, checksum mismatch)"
            raise CorruptChunkError(f"partition {pid} column '{ref.column}' rows {format_rows(ref.rows)}: stored chunk "
                                    f"{ref.key} is {what}; the data is gone, regenerate the step")
        return decode_chunk(payload)


def _rows_text(rows: np.ndarray) -> str:
    """format_rows(rows) without its per-row Python loop in the common case, a contiguous put."""
    if rows.size > 1 and rows[-1] - rows[0] == rows.size - 1 and bool(np.all(np.diff(rows) == 1)):
        return f"{rows[0]}-{rows[-1]}"
    return format_rows(rows)


def _row_blocks(array: pa.Array, limit: int) -> list[tuple[int, int]]:
    """[lo, hi) row ranges splitting `array` into blocks of about `limit` bytes (at least one block)."""
    n = len(array)
    if array.nbytes <= limit:
        return [(0, n)]
    k = min(-(-array.nbytes // limit), n)
    bounds = np.linspace(0, n, k + 1).astype(np.int64)
    return list(zip(bounds[:-1].tolist(), bounds[1:].tolist()))


def _gather(arrays: list[pa.Array], owner: np.ndarray, pos: np.ndarray, rows: np.ndarray,
            arrow_type: pa.DataType) -> pa.Array | pa.ChunkedArray:
    """Rows `rows` from the chunks. Runs of consecutive rows within a chunk become zero-copy slices
    (a shard of a partition written in a few puts costs no copy); scattered rows are gathered with take."""
    if not arrays or not rows.size:
        return pa.array([], type=arrow_type)
    which = owner[rows]
    where = pos[rows]
    breaks = np.flatnonzero((np.diff(which) != 0) | (np.diff(where) != 1)) + 1
    if breaks.size < 2 * len(arrays):
        starts = np.concatenate([[0], breaks])
        ends = np.concatenate([breaks, [rows.size]])
        pieces = [arrays[which[a]].slice(int(where[a]), int(b - a)) for a, b in zip(starts, ends)]
        return pieces[0] if len(pieces) == 1 else pa.chunked_array(pieces, type=arrow_type)
    if len(arrays) > 1:
        sizes = np.array([len(a) for a in arrays], dtype=np.int64)
        base = np.concatenate([[0], np.cumsum(sizes)[:-1]])
        combined = pa.concat_arrays(arrays)
        idx = base[which] + where
    else:
        combined, idx = arrays[0], where
    return combined.take(pa.array(idx))
