"""The column-store semantics every backend shares (docs/architecture.md §5).

`ColumnStore` implements the public API once: validation against the declared schema, row identity,
write-once cells, all-or-nothing puts, missing-cell errors, checksummed blocks and readiness. It works over
one storage object (storage.py, the protocol a backend implements), which it calls and never extends: a
backend class such as ShmStore passes its storage to `ColumnStore.__init__` and adds public methods only.

A put becomes one block per `chunk_bytes` of rows, holding every column of the put as its own flat
buffers (chunks.py): validation reads each column once, encoding is one copy per column buffer, and
checksums go per column, so a reader verifies just what it reads. The storage stores the bytes first
and commits their refs last, so a failed or concurrent put never leaves a half-written partition. How a
get becomes a table is reads.py.
"""

from __future__ import annotations

import contextlib
import math
import numbers
import time
from collections import OrderedDict
from typing import Any, Mapping, Sequence

import numpy as np
import pyarrow as pa

from dataplane_rl.errors import (
    AlignmentError,
    ConfigError,
    DataPlaneError,
    DuplicateWriteError,
    MissingColumnError,
    PartitionNotFoundError,
    SchemaError,
    StoreTimeoutError,
    StoreUnavailableError,
    format_rows,
)
from dataplane_rl.schema import Schema, load_schema
from dataplane_rl.store import reads, stats
from dataplane_rl.store.arrow import arrow_types, flatten, make_blocks, schema_of, to_arrow
from dataplane_rl.store.capabilities import Capabilities
from dataplane_rl.store.chunks import PID, ChunkRef, NotFinite, PartitionMeta, Snapshot
from dataplane_rl.store.index import RowIndex, as_slice, overlap
from dataplane_rl.store.rows import PutWhere, row_ids
from dataplane_rl.store.stats import PartitionStatus
from dataplane_rl.store.storage import Storage

# Rows per partition: the row index keeps two int32 arrays of num_rows per column, so more would be
# gigabytes of bookkeeping
MAX_ROWS = 1 << 26
# Partitions whose catalog state one process keeps cached (a step touches a few; a run, thousands)
KNOWN_PARTITIONS = 64


class ColumnStore(Capabilities):
    """A partitioned, write-once column store over one `Storage` (storage.py), which a backend supplies."""

    scheme: str = ""
    # A put is stored as row blocks of about this many bytes, so a reader of a shard checksums only the
    # blocks holding its rows, not the whole put once per reader.
    chunk_bytes: int = 4 << 20

    def __init__(self, storage: Storage, counters: stats.Counters | None = None) -> None:
        """`counters`: where this store counts its calls; given by a backend whose storage counts into them
        too (Mooncake's retries)."""
        self._storage = storage
        self._closed = False
        self._indexes: dict[str, tuple[str, RowIndex]] = {}
        self._known: OrderedDict[str, None] = OrderedDict()  # partitions touched here, least recent first
        self._counters = counters if counters is not None else stats.Counters()

    @property
    def storage(self) -> Storage:
        """What holds the bytes and the catalog (storage.py): the backend's half of the store."""
        return self._storage

    @property
    def url(self) -> str:
        """A URL another process can pass to open_store to reach the same data."""
        return self._storage.url

    # -- public API ------------------------------------------------------------------------------
    def create_partition(self, pid: str, schema: str | Schema = "grpo", num_rows: int = 0) -> None:
        """Create partition `pid` of `num_rows` rows following `schema` (a name, path or Schema)."""
        self._check_open()
        if not isinstance(pid, str) or not PID.fullmatch(pid):
            raise SchemaError(f"partition id {pid!r} is invalid; use 1-128 characters of letters, digits, '.', '_', '-'")
        if isinstance(num_rows, bool) or not isinstance(num_rows, (int, np.integer)) or not 0 <= num_rows <= MAX_ROWS:
            raise SchemaError(f"partition {pid}: num_rows={num_rows!r} must be an integer from 0 to at most "
                              f"{MAX_ROWS}; split larger batches over several partitions")
        s = load_schema(schema)
        if not s.bound:  # a shape names a config value: its default, as in a run that does not set it
            from dataplane_rl.config import bound_schema

            s = bound_schema(s)
        self._storage.create(PartitionMeta(pid, s.json_text, int(num_rows)))

    def put(self, pid: str, columns: Mapping[str, Any], rows: Any) -> None:
        """Write `columns` for `rows` (indices or a range). All or nothing; every cell once."""
        self._check_open()
        t0 = time.perf_counter()
        try:
            nbytes = self._put(pid, columns, rows)
        except DataPlaneError as e:
            self._counters.refused(e)
            raise
        self._counted("put", nbytes, t0)

    def _counted(self, op: str, nbytes: int, t0: float) -> None:
        c = self._counters
        c.call(op, nbytes, time.perf_counter() - t0)
        if c.due():
            self._storage.share_counters(c.metrics(), final=False)

    def _put(self, pid: str, columns: Mapping[str, Any], rows: Any) -> int:
        known = self._storage.known_snapshot(pid) if isinstance(pid, str) and pid in self._known else None
        if known is None:
            return self._put_from(pid, self._snap(pid), False, columns, rows)
        self._known.move_to_end(pid)
        try:
            return self._put_from(pid, known, True, columns, rows)
        except PartitionNotFoundError as e:
            # what this process knew is gone: dropped (the commit saw it), and maybe made again: look it up
            self._storage.forget(pid)
            try:
                snap = self._snap(pid)
            except PartitionNotFoundError:
                raise e from None
            return self._put_from(pid, snap, False, columns, rows)

    def _put_from(self, pid: str, snap: Snapshot, known: bool, columns: Mapping[str, Any], rows: Any) -> int:
        """A put starting from `snap`: what this process already held of the partition if `known` (no catalog
        read; a stale one ends in PartitionNotFoundError before anything is committed), else a fresh read."""
        meta, schema = snap.meta, schema_of(snap.meta)
        rows = self._rows(pid, meta, rows, unique=True)
        where = PutWhere(pid, rows)
        if type(columns) is not dict and not isinstance(columns, Mapping):  # dict first: an ABC check costs µs
            raise SchemaError(f"{where} columns must be a mapping {{column name: data}}, got {type(columns).__name__}")
        if not columns:
            raise SchemaError(f"{where} no columns given; pass {{column: data}}")
        arrays = {}
        types, by_name = arrow_types(meta.schema_json), schema.by_name
        n, aligned = len(rows), True
        for name, data in columns.items():
            if not isinstance(name, str) or name not in by_name:
                try:
                    schema.column(name if isinstance(name, str) else repr(name))
                except SchemaError as e:  # name the partition and rows too
                    raise SchemaError(f"{where} {e}") from None
            want = types[name]
            arr = data if type(data) is not pa.ChunkedArray and getattr(data, "type", None) == want \
                and isinstance(data, pa.Array) else to_arrow(by_name[name], data, where, want)
            arrays[name] = arr
            aligned = aligned and len(arr) == n
        if not aligned:
            bad = {k: len(a) for k, a in arrays.items() if len(a) != n}
            desc = ", ".join(f"'{k}' has {m}" for k, m in bad.items())
            raise AlignmentError(f"{where} {desc} values for {len(rows)} rows; every column in one put must "
                                 "cover exactly the given rows")
        if not len(rows):  # checked and nothing to write: no block on any backend (Mooncake refuses an empty object)
            return 0
        lengths = None
        if schema.length_column not in arrays:
            tokens = [n for n in arrays if by_name[n].kind == "token"]
            if tokens:  # checked against the length column: what every writer committed of it
                lengths = self._stored_lengths(snap, rows, tokens, held=known)
        flat = flatten(schema, arrays, lengths)
        if flat is None:  # something may be wrong: the exact check names it (or finds nothing)
            schema.check(arrays, lengths, where=str(where)[:-1], rows=rows)
            flat = flatten(schema, arrays, lengths, validate=False)
        # a storage whose commit checks write-once alone (shm's claims) needs no check against a held snapshot
        err = None if known and self._storage.checks_alone else self._conflict(snap, rows=rows, columns=list(arrays))
        if err:
            raise err
        try:
            staged = self._storage.store(meta, make_blocks(rows, tuple(arrays), *flat, self.chunk_bytes))
        except NotFinite:  # the store gave back what it wrote; the exact check names the cells
            schema.check(arrays, lengths, where=str(where)[:-1], rows=rows)
            parts = [p._replace(finite=False) for p in flat[0]]  # huge finite values overflowed v.v: fine
            staged = self._storage.store(meta, make_blocks(rows, tuple(arrays), parts, flat[1], self.chunk_bytes))
        try:
            self._storage.commit(meta, staged, snap.refs, self._conflict)
        except BaseException:
            self._storage.discard(meta, staged.refs)
            raise
        return sum(r.nbytes for r in staged.refs)

    def get(self, pid: str, fields: str | Sequence[str], rows: Any = None) -> pa.Table:
        """The requested fields for `rows` (default all), in the requested row order, as an Arrow table."""
        self._check_open()
        t0 = time.perf_counter()
        try:
            snap = self._snap(pid)
            fields = self._field_list(pid, snap.meta, fields, "get")
            if len(set(fields)) != len(fields):
                raise SchemaError(f"partition {pid} get: a field is requested twice in {fields}")
            try:
                table = self._table(snap, fields, self._rows(pid, snap.meta, rows, unique=False))
            except MissingColumnError as e:
                raise self._storage.unwritten(pid, e) from None
        except DataPlaneError as e:
            self._counters.refused(e)
            raise
        self._counted("get", 0, t0)  # its bytes: counted by _table, per block read
        return table

    def ready(self, pid: str, fields: str | Sequence[str]) -> np.ndarray:
        """The rows (sorted int64) on which every named field is written. Reads the catalog, never data."""
        self._check_open()
        snap = self._snap(pid)
        fields = self._field_list(pid, snap.meta, fields, "ready")
        idx = self._index_of(snap)
        with idx.lock:
            return idx.ready(fields)

    def wait(self, pid: str, fields: str | Sequence[str], rows: Any = None, timeout: float = 60.0) -> np.ndarray:
        """Block until every named field is written on `rows` (default all); return those rows.

        Raises StoreTimeoutError after `timeout` seconds naming the rows and fields still missing, and
        PartitionNotFoundError at once if the partition does not exist (or is dropped while waiting)."""
        self._check_open()
        # NaN compares false with every deadline (a wait that never ends); a string fails deep in the loop
        if isinstance(timeout, bool) or not isinstance(timeout, numbers.Real) or not math.isfinite(timeout) or timeout < 0:
            raise ConfigError(f"partition {pid} wait: timeout={timeout!r} must be a finite number of seconds >= 0")
        snap = self._snap(pid)
        fields = self._field_list(pid, snap.meta, fields, "wait")
        want = self._rows(pid, snap.meta, rows, unique=False)
        deadline = time.monotonic() + timeout
        pause = 0.0005
        while True:
            idx = self._index_of(snap)
            with idx.lock:
                missing = {f: lack for f in fields if (lack := idx.unwritten(f, want)).size}
            if not missing:
                return want
            left = deadline - time.monotonic()
            if left <= 0:
                detail = "; ".join(f"{f}: rows {format_rows(np.unique(r))}" for f, r in missing.items())
                raise self._storage.unwritten(pid, StoreTimeoutError(
                    f"partition {pid}: waited {timeout:g} s and these cells are still unwritten: {detail}; check "
                    "that the writer is alive, or raise the timeout"))
            # back off from 0.5 ms to 20 ms: one catalog read per wake-up, no spinning
            time.sleep(min(pause, left))
            pause = min(pause * 2, 0.02)
            snap = self._storage.snapshot(pid)

    def counters(self) -> dict[str, float]:
        """This process's own counters of the store's calls, read from memory (no catalog, no other
        process): what `stats()` adds the others' to. A benchmark's worker reports its retries from here."""
        return self._counters.metrics()

    def stats(self, partitions: list[str] | None = None) -> dict[str, float]:
        """The store's counters and gauges, in Prometheus names (`_total`, `_seconds`, `_bytes`): puts and
        gets with their bytes and seconds and refusals by cause (of every process that wrote them where
        this one can read them: shm; else of this process), cells and bytes of the live `partitions` (default
        every one; a damaged one is counted, not raised), and the backend's space (shm: the arena's capacity,
        allocated, pooled and free bytes)."""
        self._check_open()
        storage = self._storage
        return stats.of_store(self, partitions, lambda: stats.add(storage.other_counters(), self._counters.metrics()),
                              storage.gauges)

    def status(self, pid: str) -> PartitionStatus:
        self._check_open()
        snap = self._snap(pid)
        schema = schema_of(snap.meta)
        written = {c: 0 for c in schema.names}
        nbytes = {c: 0 for c in schema.names}
        for ref in snap.refs:
            for c, n in zip(ref.columns, ref.sizes):
                written[c] += len(ref.rows)
                nbytes[c] += n
        return PartitionStatus(pid, schema.name, snap.meta.num_rows, written, nbytes)

    def list_partitions(self) -> list[str]:
        self._check_open()
        return sorted(self._storage.list())

    def drop_partition(self, pid: str) -> None:
        self._check_open()
        self._storage.drop(self._check_pid(pid))
        self._indexes.pop(pid, None)
        self._known.pop(pid, None)

    def schema(self, pid: str) -> Schema:
        """The schema partition `pid` was created with."""
        self._check_open()
        return schema_of(self._snap(pid).meta)

    def num_rows(self, pid: str) -> int:
        self._check_open()
        return self._snap(pid).meta.num_rows

    def close(self) -> None:
        if not self._closed:
            self._closed = True
            self._indexes.clear()
            with contextlib.suppress(Exception):  # a store that is gone keeps no counters
                self._storage.share_counters(self._counters.metrics(), final=True)
            self._storage.close()

    def __enter__(self) -> "ColumnStore":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.url!r})"

    # -- helpers -----------------------------------------------------------------------------------
    def _snap(self, pid: Any) -> Snapshot:
        """The storage's snapshot, for a public call. A process caches each partition it touches (row index, meta,
        refs); a reader never drops the partitions it reads (the driver does), so only the last
        KNOWN_PARTITIONS stay cached and older ones are forgotten (measured before: a train worker grew
        ~36 kB per step over 1000 steps)."""
        snap = self._storage.snapshot(self._check_pid(pid))
        known = self._known
        if pid in known:
            known.move_to_end(pid)
        else:
            known[pid] = None
            while len(known) > KNOWN_PARTITIONS:
                old, _ = known.popitem(last=False)
                self._indexes.pop(old, None)
                self._storage.forget(old)
        return snap

    def _index_of(self, snap: Snapshot) -> RowIndex:
        """The row index of `snap`'s refs, extended from the last one this process built when it can."""
        pid, token = snap.meta.pid, snap.meta.token
        known = self._indexes.get(pid)
        if known is not None and known[0] == token:
            idx = known[1]
            with idx.lock:
                if idx.extends(snap.refs):
                    idx.add(snap.refs[len(idx.refs):])
                    return idx
        idx = RowIndex(snap.meta.num_rows)
        idx.add(snap.refs)
        self._indexes[pid] = (token, idx)
        return idx

    def _table(self, snap: Snapshot, fields: list[str], rows: np.ndarray) -> pa.Table:
        return reads.table(snap, self._index_of(snap), fields, rows, self._storage.read, self._counters)

    def _stored_lengths(self, snap: Snapshot, rows: np.ndarray, token_cols: list[str], held: bool) -> np.ndarray:
        """The committed lengths of `rows`, which a put's token columns are checked against. `held`: `snap` is
        what this process already held, which may predate the lengths another writer committed: on a miss,
        the catalog is read before the put is refused."""
        length_col = schema_of(snap.meta).length_column
        idx = self._index_of(snap)
        with idx.lock:
            known = idx.known_lengths(rows)
        if known is not None:
            return known
        try:
            col = self._table(snap, [length_col], rows).column(0)
        except MissingColumnError as e:
            if held:
                return self._stored_lengths(self._snap(snap.meta.pid), rows, token_cols, held=False)
            raise MissingColumnError(f"{e}; token column(s) {token_cols} are checked against {length_col}, "
                                     f"so write {length_col} first or in the same put") from None
        return col.to_numpy().astype(np.int64)

    def _conflict(self, snap: Snapshot, refs: list[ChunkRef] | None = None, *, rows: np.ndarray | None = None,
                  columns: list[str] | None = None) -> DuplicateWriteError | None:
        """The error for the first cell of `refs` (or of `columns` x `rows`) already committed in `snap`."""
        idx = self._index_of(snap)
        with idx.lock:
            if refs is not None:
                hit = overlap(idx, refs)
            else:
                at = as_slice(rows)
                hit = next(((c, h) for c in columns if (h := idx.written(c, at)).size), None)
        if hit is None:
            return None
        name, cells = hit
        writer = schema_of(snap.meta).by_name[name].writer
        return DuplicateWriteError(f"partition {snap.meta.pid} column '{name}' rows {format_rows(cells)} already "
                                   f"written (writer: {writer}); cells are written once, write a new partition instead")

    # -- shared helpers --------------------------------------------------------------------------
    def _check_open(self) -> None:
        if self._closed:
            raise StoreUnavailableError(f"store {self.url} is closed; open a new one with open_store")

    def _check_pid(self, pid: Any) -> str:
        if not isinstance(pid, str) or not PID.fullmatch(pid):
            raise PartitionNotFoundError(f"partition {pid!r} is unknown in {self.url}: a partition id is 1-128 "
                                         "letters, digits, '.', '_', '-'")
        return pid

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

    def _rows(self, pid: str, meta: PartitionMeta, rows: Any, *, unique: bool) -> np.ndarray:
        return row_ids(pid, meta.num_rows, rows, unique=unique)
