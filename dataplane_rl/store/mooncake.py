"""`mooncake://[HOST:PORT]`: columns in the Mooncake distributed store, for more than one machine (DESIGN §4).

`mooncake://` starts a cluster of its own (a master and `num_holders` holder processes on free 127.0.0.1
ports, see MooncakeCluster) and stops it on close(); `store.cluster` is that cluster. `mooncake://HOST:PORT`
joins a running master as a pure client. The master's admin HTTP server is taken to be on PORT+1 (true
for masters MooncakeCluster starts); name another with `mooncake://HOST:PORT?admin=HOST:Q`. `store.url`
is always the master's address, so other processes (Ray actors, readers, the CLI) open the same store as
clients, which never start or stop anything and contribute no memory: data outlives every client.

Keys (a few per put, never one per cell or sample: over TCP Mooncake costs ~100 us per key):

    dprl/<pid>/meta          the PartitionMeta and an incarnation id <inc>; put-if-absent
    dprl/<pid>/i/<inc>       marker: this incarnation of the partition is live
    dprl/<pid>/lock          lock of create and drop: a put session, never published
    dprl/<pid>/r/<n>         the n-th committed put: {"inc", "refs": [ChunkRef...]}; put-if-absent
    dprl/<pid>/c/<inc>/<id>  chunks of one put (up to PACK_BYTES): Arrow IPC streams, one per column and
                             row block, at 64-byte-aligned offsets; a ChunkRef's key is `<object>@<offset>`

Put: chunks are serialized straight into a registered arena (one copy), back to back, and stored with one
put session: `batch_put_session_start` (reserve), `batch_put_from_multi_buffer_ranges` (fill from the
arena), `batch_put_session_end` (publish), one call each for the whole put. The commit then wins the next
refs slot r/<n> with a put session (Mooncake's only atomic put-if-absent), after checking conflicts against
slots 0..n-1: whoever reserves slot n first is its only writer, so the slot is the commit lock and a put
never takes `lock`. Get: refs are cached per process; a known partition is checked with one master RPC
(`batch_is_exist` of the marker and the next slots: no data moves), a new one read with one
`batch_get_into` (meta and the first slots); then one `get_into_ranges` reads just the chunks' byte ranges
into a registered buffer that the returned Arrow arrays keep alive (reused once they are gone). So a put
costs two data calls (chunks, refs) and four master RPCs, a get one data call plus one RPC or one small
read. Keys are never listed on the data path: `/get_all_keys` over the admin HTTP port serves
list_partitions only. A partition dropped and created again has a new <inc>: nothing of the old one (say a
refs slot published by a commit racing the drop) is read as the new one's.

Measured on the 2-core box (5.7 MB put, 2 readers of half the rows each): one object per put instead of
one per chunk (13) stores ~30% faster and reads no slower; put sessions instead of `batch_put_from`, ~10%
faster end to end; gathering the user's Arrow buffers zero-copy (through a Python IPC sink) is slower than
the one copy. A master RPC costs ~0.13 ms, a small transfer ~0.3-0.5 ms with a tail of several ms under
load, so the catalog uses RPCs where it can.

Mooncake quirks (docs/mooncake_notes.md), each turned into an error or prevented:
- a put of an existing key returns OK and keeps the old value: chunk keys are unique, and every catalog
  key that can be contended is written with a put session, Mooncake's atomic put-if-absent;
- a get of a missing key returns b"" or -704: reads use batch_get_into / get_into_ranges and check every
  code (a range past the end of a cut object: -600), so a lost chunk is an error naming it;
- a full segment evicts silently: every put is hard-pinned (`no_eviction_config`) and NO_AVAILABLE_HANDLE
  becomes "mooncake store full", after removing what the put had written;
- data dies with its holder: a self-started cluster is polled on every operation (`cluster.check()`),
  and TRANSFER_FAIL / OBJECT_NOT_FOUND reads name the partition, column and rows that were lost;
- a put session left open by a dead process blocks its key: the master discards it after
  put_start_discard_timeout_sec (30 s by default, measured), which is what breaks a dead writer's lock.
"""

from __future__ import annotations

import contextlib
import inspect
import json
import logging
import re
import threading
import time
import uuid
import weakref
from dataclasses import dataclass, field
from typing import Any, Iterator
from urllib.parse import parse_qsl, urlencode

import numpy as np
import pyarrow as pa

from dataplane_rl.errors import (
    ConfigError,
    CorruptChunkError,
    PartitionExistsError,
    PartitionNotFoundError,
    StoreUnavailableError,
    format_rows,
)
from dataplane_rl.store.base import _PID, ChunkRef, ColumnStore, PartitionMeta, checksum
from dataplane_rl.store.mooncake_cluster import (
    INVALID_PARAMS,
    MAX_KEYS_PER_BATCH,
    MIN_SEGMENT_SIZE,
    NO_AVAILABLE_HANDLE,
    OBJECT_ALREADY_EXISTS,
    OBJECT_NOT_FOUND,
    OK,
    REPLICA_IS_NOT_READY,
    RPC_FAIL,
    TRANSFER_FAIL,
    MooncakeCluster,
    connect_client,
    default_admin_address,
    error_name,
    import_mooncake_store,
    list_keys,
    no_eviction_config,
    split_address,
)
from dataplane_rl.store.shm import _write_ipc  # the IPC writer with fixed options, shared with shm

log = logging.getLogger(__name__)

PREFIX = "dprl/"
_ALIGN = 64
_SLOT = 64 << 10  # bytes per catalog key in one batched read; a bigger value is re-read at its size
_PROBE = 4  # refs keys asked for beyond the last one known, per catalog read (doubling up to _MAX_PROBE)
_MAX_PROBE = 64
# Chunks of one put are stored as objects of up to this size: measured, one 5.7 MB object takes ~30% less
# time to store than 13 of ~0.5 MB (the cost per key), while a cap lets a big put spread over holders
# (Mooncake never splits an object across segments) and fits the smallest segment Mooncake allows.
PACK_BYTES = MIN_SEGMENT_SIZE
CLIENT_ARENA_BYTES = 32 << 20
_TRANSPORT_DEFAULTS = {k: p.default for k, p in inspect.signature(connect_client).parameters.items()
                       if k in ("protocol", "device_name", "metadata_server", "local_hostname")}
LOCK_TIMEOUT_S = 120.0  # longer than the master's put_start_discard_timeout_sec (30 s), which frees dead locks


def _align(n: int) -> int:
    return -(-n // _ALIGN) * _ALIGN


def _write_at(buf: "_Buffer", offset: int, batch: pa.RecordBatch) -> int | None:
    """Write `batch` as an IPC stream into `buf` at `offset`; its size, or None if it does not fit."""
    sink = pa.FixedSizeBufferWriter(pa.py_buffer(buf.array[offset:]))
    try:
        _write_ipc(sink, batch)
    except OSError as e:
        if "out of bounds" not in str(e):
            raise
        return None
    return sink.tell()


def _split(chunk_key: str) -> tuple[str, int]:
    """'<object key>@<offset>' -> (object key, offset)."""
    key, _, off = chunk_key.rpartition("@")
    return key, int(off)


def _batches(n: int) -> Iterator[slice]:
    for lo in range(0, n, MAX_KEYS_PER_BATCH):
        yield slice(lo, min(n, lo + MAX_KEYS_PER_BATCH))


# ---- registered memory ---------------------------------------------------------------------------
class _Buffer:
    """A numpy byte buffer registered with the client (zero-copy transfers need registered memory)."""

    def __init__(self, client, nbytes: int) -> None:
        self.array = np.empty(nbytes, dtype=np.uint8)
        self.ptr = self.array.ctypes.data
        self.client = client
        rc = client.register_buffer(self.ptr, nbytes)
        if rc != 0:
            raise StoreUnavailableError(f"Mooncake register_buffer of {nbytes} bytes failed: {error_name(rc)}; "
                                        "lower data_plane.mooncake.local_buffer_size_mb")

    @property
    def nbytes(self) -> int:
        return self.array.nbytes

    def release(self) -> None:
        with contextlib.suppress(Exception):
            self.client.unregister_buffer(self.ptr)


class _Lease:
    """One get's landing buffer; the Arrow buffers handed out keep it alive, and it returns to the pool."""

    def __init__(self, buf: _Buffer) -> None:
        self.buf = buf


class _ReadPool:
    """Registered landing buffers for gets, reused once no returned array uses them (fresh pages cost a
    page fault each), keeping at most `keep_bytes` idle."""

    def __init__(self, client, keep_bytes: int) -> None:
        self._client, self._keep = client, keep_bytes
        self._free: list[_Buffer] = []
        self._lock = threading.Lock()
        self._closed = False

    def take(self, nbytes: int) -> _Lease:
        with self._lock:
            fits = [b for b in self._free if nbytes <= b.nbytes <= 4 * nbytes + (1 << 20)]
            buf = min(fits, key=lambda b: b.nbytes) if fits else None
            if buf is not None:
                self._free.remove(buf)
        if buf is None:
            buf = _Buffer(self._client, max(1 << 20, 1 << (max(nbytes, 1) - 1).bit_length()))
        lease = _Lease(buf)
        weakref.finalize(lease, self._give_back, buf)
        return lease

    def _give_back(self, buf: _Buffer) -> None:
        with self._lock:
            if not self._closed:
                self._free.append(buf)
                while sum(b.nbytes for b in self._free) > self._keep:
                    self._free.pop(0).release()

    def close(self) -> None:
        with self._lock:
            self._closed = True
            for b in self._free:
                b.release()
            self._free.clear()


@dataclass
class _Object:
    """Consecutive chunks of one put in the arena, stored as one Mooncake object: [start, end)."""

    key: str
    start: int
    end: int = 0
    chunks: list[tuple[str, np.ndarray, int]] = field(default_factory=list)  # (column, rows, size)


@dataclass
class _Part:
    """What this process knows of a partition: its incarnation, meta and committed refs (by index)."""

    inc: str
    meta: PartitionMeta
    refs: dict[int, list[ChunkRef]] = field(default_factory=dict)

    @property
    def count(self) -> int:
        n = 0
        while n in self.refs:
            n += 1
        return n

    def chunks(self, n: int | None = None) -> list[ChunkRef]:
        """The refs of the first n commits (default: all known)."""
        return [r for i in range(self.count if n is None else n) for r in self.refs[i]]


# ---- the store -----------------------------------------------------------------------------------
class MooncakeStore(ColumnStore):
    scheme = "mooncake"
    # Smaller row blocks than the default: a reader of a row shard fetches only the blocks holding its
    # rows, and over TCP a read costs per byte fetched, while one more key costs only ~100 us.
    chunk_bytes = 1 << 20

    def __init__(self, address: str | None = None, *, config=None, admin: str | None = None,
                 cluster: MooncakeCluster | None = None, transport: dict[str, str] | None = None) -> None:
        """address None and no cluster: start a cluster (sized by `config`, a MooncakeConfig) and own it.
        `cluster`: use that started cluster (not owned). `transport`: protocol / device_name /
        metadata_server / local_hostname of a client opened by URL alone (they come from the URL; default tcp,
        and the node's own IP: see advertise_host)."""
        super().__init__()
        import_mooncake_store()  # StoreUnavailableError: install the `mooncake` extra (and libibverbs1)
        self._owns_cluster = address is None and cluster is None
        if config is None and self._owns_cluster:
            from dataplane_rl.config import MooncakeConfig  # imports torch (seconds): only when starting a cluster

            config = MooncakeConfig()
        self.config = config
        if config is not None:
            transport = {"protocol": config.protocol, "device_name": config.device_name,
                         "metadata_server": config.metadata_server, "local_hostname": config.local_hostname}
        if self._owns_cluster:
            cluster = MooncakeCluster(config.num_holders, config.global_segment_size_mb << 20,
                                      **{k: v for k, v in transport.items() if k != "local_hostname"}).start()
        self.cluster = cluster
        if cluster is not None:
            address, admin = cluster.master_address, cluster.admin_address
            transport = {"protocol": cluster.protocol, "device_name": cluster.device_name,
                         "metadata_server": cluster.metadata_server,
                         "local_hostname": (transport or {}).get("local_hostname")}
        split_address(address)  # StoreUnavailableError unless HOST:PORT
        self._address, self._admin = address, admin or default_admin_address(address)
        self._transport = {k: v for k, v in (transport or {}).items() if v != _TRANSPORT_DEFAULTS[k]}
        try:
            # The copying calls (get/put) are not used, so the client's own transfer buffer stays empty;
            # the registered arenas below are sized from local_buffer_size_mb instead.
            self._client = connect_client(address, 0, **self._transport)
        except BaseException:
            if self._owns_cluster:
                cluster.close()
            raise
        # without a config (a client opened by URL alone) the arena starts small and grows to the largest put
        self._arena_bytes = config.local_buffer_size_mb << 20 if config is not None else CLIENT_ARENA_BYTES
        self._pin = no_eviction_config()  # hard pin: never evicted, even by a master that evicts
        self._pool = _ReadPool(self._client, self._arena_bytes)
        self._tl = threading.local()
        self._buffers: list[_Buffer] = []  # per-thread arenas, released on close
        self._buffers_lock = threading.Lock()
        self._parts: dict[str, _Part] = {}
        self.lock_timeout_s = LOCK_TIMEOUT_S

    @classmethod
    def from_url(cls, rest: str, config=None, **options: Any) -> "MooncakeStore":
        """mooncake:// or mooncake://HOST:PORT[?admin=HOST:PORT&protocol=rdma&device_name=mlx5_0&metadata_server=...]."""
        address, _, query = rest.partition("?")
        params = dict(parse_qsl(query))
        admin = params.pop("admin", None)
        unknown = sorted(set(params) - set(_TRANSPORT_DEFAULTS)) + sorted(options)
        if unknown or "/" in address or (not address and (admin or params)):
            raise ConfigError(f"mooncake://{rest}: unknown option(s) {unknown or query or address!r}; use mooncake:// "
                              "(start a local cluster, sized and configured by config=MooncakeConfig(...)) or "
                              "mooncake://HOST:PORT[?admin=HOST:PORT&protocol=...&device_name=...&metadata_server=...&local_hostname=IP]")
        return cls(address or None, config=config, admin=admin, transport=params or None)

    @property
    def url(self) -> str:
        query = dict(self._transport)
        if self._admin != default_admin_address(self._address):
            query["admin"] = self._admin
        return f"mooncake://{self._address}" + ("?" + urlencode(query) if query else "")

    # -- keys ------------------------------------------------------------------------------------
    @staticmethod
    def _meta_key(pid: str) -> str:
        return f"{PREFIX}{pid}/meta"

    @staticmethod
    def _marker_key(pid: str, inc: str) -> str:
        return f"{PREFIX}{pid}/i/{inc}"

    @staticmethod
    def _lock_key(pid: str) -> str:
        return f"{PREFIX}{pid}/lock"

    @staticmethod
    def _refs_key(pid: str, n: int) -> str:
        return f"{PREFIX}{pid}/r/{n}"

    @staticmethod
    def _inc_of(chunk_key: str) -> str:
        return chunk_key.split("/")[3]  # dprl/<pid>/c/<inc>/<id>@<offset>

    # -- per-thread registered buffers ------------------------------------------------------------
    def _buffer(self, name: str, nbytes: int) -> _Buffer:
        """This thread's registered buffer `name`, at least `nbytes` long (grown, never shrunk)."""
        buf = getattr(self._tl, name, None)
        if buf is None or buf.nbytes < nbytes:
            new = _Buffer(self._client, nbytes if buf is None else max(nbytes, 2 * buf.nbytes))
            with self._buffers_lock:
                if buf is not None:
                    self._buffers.remove(buf)
                    buf.release()
                self._buffers.append(new)
            setattr(self._tl, name, new)
            buf = new
        return buf

    # -- errors ----------------------------------------------------------------------------------
    def _check_cluster(self, where: str) -> None:
        """A self-started cluster is polled (µs): a dead holder is named at once, not after a slow read."""
        if self.cluster is None:
            return
        try:
            self.cluster.check()
        except StoreUnavailableError as e:
            raise StoreUnavailableError(f"{where}: {e}\nThe data that process held died with it; close this store, "
                                        "open a new one and regenerate the partitions") from None

    def _error(self, code: int, what: str) -> StoreUnavailableError:
        self._check_cluster(what)
        name = error_name(code)
        if code == NO_AVAILABLE_HANDLE:
            room = (f"{self.cluster.num_holders} holder(s) x {self.cluster.global_segment_size >> 20} MiB"
                    if self.cluster is not None else f"the holders of {self.url}")
            return StoreUnavailableError(f"{what}: mooncake store full ({name}; {room}): drop old partitions, or raise "
                                         "data_plane.mooncake.global_segment_size_mb or num_holders")
        if code == RPC_FAIL:
            return StoreUnavailableError(f"{what}: the Mooncake master at {self._address} is unreachable ({name}); "
                                         "restart it (its data is lost) and regenerate the partitions")
        if code == TRANSFER_FAIL:
            return StoreUnavailableError(f"{what}: a Mooncake holder is unreachable ({name}): data died with its "
                                         "holder; restart the store and regenerate the partitions")
        return StoreUnavailableError(f"{what}: Mooncake answered {name}")

    def _not_found(self, pid: str, why: str = "is unknown or dropped") -> PartitionNotFoundError:
        try:
            live = sorted(self._list()) or "none"
        except StoreUnavailableError:
            live = "unknown"
        return PartitionNotFoundError(f"partition {pid} {why} in {self.url}; live partitions: {live}")

    # -- small catalog values ----------------------------------------------------------------------
    def _get_small(self, keys: list[str]) -> list[bytes | None]:
        """Values of small keys in one batch_get_into; None for a missing (or not yet published) key."""
        buf = self._buffer("catalog", len(keys) * _SLOT)
        codes = self._client.batch_get_into(keys, [buf.ptr + i * _SLOT for i in range(len(keys))], [_SLOT] * len(keys))
        out: list[bytes | None] = []
        for i, (key, code) in enumerate(zip(keys, codes)):
            if code >= 0:
                out.append(buf.array[i * _SLOT:i * _SLOT + code].tobytes())
            elif code in (OBJECT_NOT_FOUND, REPLICA_IS_NOT_READY):
                out.append(None)
            elif code == INVALID_PARAMS:  # bigger than its slot: read it alone at its size
                out.append(self._get_big(key))
            else:
                raise self._error(code, f"reading catalog key {key}")
        return out

    def _get_big(self, key: str) -> bytes | None:
        size = self._client.get_size(key)
        if size < 0:
            return None
        buf = self._buffer("catalog", size)
        code = self._client.batch_get_into([key], [buf.ptr], [size])[0]
        if code in (OBJECT_NOT_FOUND, REPLICA_IS_NOT_READY):
            return None
        if code < 0:
            raise self._error(code, f"reading catalog key {key}")
        return buf.array[:code].tobytes()

    def _put_if_absent(self, key: str, data: bytes, must_exist: str | None = None) -> int:
        """OK; OBJECT_ALREADY_EXISTS if the key exists or is being written; OBJECT_NOT_FOUND if the key
        `must_exist` does not (checked in the same call, at no cost: reserving an existing key fails).

        Mooncake quirk: a plain put of an existing key returns OK and keeps the old value; a put session
        is its one atomic put-if-absent (another client's reservation or key: -705; our own: -600)."""
        buf = self._buffer("catalog", len(data))
        buf.array[:len(data)] = np.frombuffer(data, dtype=np.uint8)
        keys = [key] if must_exist is None else [key, must_exist]
        codes = self._client.batch_put_session_start(keys, [len(data), 1][:len(keys)], self._pin)
        if must_exist is not None and codes[1] == OK:  # it was not there: we just reserved it
            self._client.batch_put_session_revoke([k for k, c in zip(keys, codes) if c == OK])
            return OBJECT_NOT_FOUND
        if must_exist is not None and codes[1] not in (OBJECT_ALREADY_EXISTS, INVALID_PARAMS):
            self._client.batch_put_session_revoke([key] if codes[0] == OK else [])
            raise self._error(codes[1], f"checking catalog key {must_exist}")
        if codes[0] in (OBJECT_ALREADY_EXISTS, INVALID_PARAMS):
            return OBJECT_ALREADY_EXISTS
        if codes[0] != OK:
            raise self._error(codes[0], f"writing catalog key {key}")
        self._fill([(key, buf.ptr, len(data))], f"writing catalog key {key}")
        return OK

    def _fill(self, items: list[tuple[str, int, int]], what: str) -> None:
        """Fill and publish keys reserved by batch_put_session_start ((key, address, size) each); on any
        failure revoke every reservation not yet published and raise."""
        keys = [k for k, _, _ in items]
        ended: set[str] = set()
        try:
            for s in _batches(len(items)):
                part = items[s]
                wrote = self._client.batch_put_from_multi_buffer_ranges(
                    keys[s], [[p] for _, p, _ in part], [[n] for _, _, n in part], [[0]] * len(part))
                bad = next(((w, n) for w, (_, _, n) in zip(wrote, part) if w != n), None)
                if bad is not None:
                    raise self._error(bad[0] if bad[0] < 0 else TRANSFER_FAIL, f"{what} ({bad[0]} of {bad[1]} bytes)")
            for s in _batches(len(items)):
                codes = self._client.batch_put_session_end(keys[s])
                ended.update(k for k, c in zip(keys[s], codes) if c == OK)
                bad = next((c for c in codes if c != OK), None)
                if bad is not None:
                    raise self._error(bad, what)
        except BaseException:
            with contextlib.suppress(Exception):
                left = [k for k in keys if k not in ended]
                for s in _batches(len(left)):
                    self._client.batch_put_session_revoke(left[s])
            raise

    # -- catalog -----------------------------------------------------------------------------------
    def _fetch(self, pid: str) -> _Part:
        """The partition's meta and committed refs. A known partition costs one master RPC (is its
        incarnation's marker there, and any refs key after the last known?) plus one read of new refs;
        an unknown one, one read of the meta with the first refs keys."""
        if not isinstance(pid, str) or not _PID.match(pid):
            raise self._not_found(pid)
        self._check_cluster(f"partition {pid}")
        part = self._parts.get(pid)
        if part is not None and self._refresh(pid, part):
            return part
        vals = self._get_small([self._meta_key(pid)] + [self._refs_key(pid, n) for n in range(_PROBE)])
        if vals[0] is None:
            self._parts.pop(pid, None)
            raise self._not_found(pid)
        doc = json.loads(vals[0])
        part = _Part(doc.pop("incarnation"), PartitionMeta.from_json(json.dumps(doc)))
        self._parts[pid] = part
        if self._take_refs(part, 0, vals[1:]) == _PROBE:
            self._refresh(pid, part)
        return part

    def _refresh(self, pid: str, part: _Part) -> bool:
        """Read the refs keys committed since this process last looked; False if the partition is gone or
        was dropped and made again (its incarnation's marker is gone)."""
        probe = _PROBE
        while True:
            n = part.count
            keys = [self._marker_key(pid, part.inc)] + [self._refs_key(pid, k) for k in range(n, n + probe)]
            there = self._client.batch_is_exist(keys)  # master only: no transfer
            bad = next((c for c in there if c < 0), None)
            if bad is not None:
                raise self._error(bad, f"partition {pid}: looking up catalog keys")
            if there[0] != 1:
                return False
            new = next((i for i, c in enumerate(there[1:]) if c != 1), probe)
            if new == 0 or self._take_refs(part, n, self._get_small(keys[1:1 + new])) < probe:
                return True
            probe = min(2 * probe, _MAX_PROBE)  # every key asked for was there: there may be many more

    @staticmethod
    def _take_refs(part: _Part, n0: int, values: list[bytes | None]) -> int:
        """Add refs values n0, n0+1, ... up to the first missing one; how many were added."""
        for i, v in enumerate(values):
            doc = json.loads(v) if v is not None else None
            if doc is None or doc["inc"] != part.inc:  # not there, or left by an earlier partition of this id
                return i
            part.refs[n0 + i] = [ChunkRef.from_json(d) for d in doc["refs"]]
        return len(values)

    def _create(self, meta: PartitionMeta) -> None:
        self._check_cluster(f"partition {meta.pid}")
        inc = uuid.uuid4().hex[:12]
        text = json.dumps({**json.loads(meta.to_json()), "incarnation": inc}).encode()
        with self._locked(meta.pid):  # serialised with a drop of the same id
            marker = self._marker_key(meta.pid, inc)
            self._put_if_absent(marker, b"1")  # first, so every published meta has its marker
            code = None
            try:
                code = self._put_if_absent(self._meta_key(meta.pid), text)
            finally:
                if code != OK:
                    self._client.remove(marker, True)
        if code == OBJECT_ALREADY_EXISTS:
            raise PartitionExistsError(f"partition {meta.pid} already exists in {self.url}; drop it first or use a new id")
        self._parts[meta.pid] = _Part(inc, PartitionMeta.from_json(meta.to_json()))

    def _meta(self, pid: str) -> PartitionMeta:
        part = self._fetch(pid)
        # The base calls _meta right before _chunks: the refs read with the meta serve that call, and a
        # put's chunks are keyed under the incarnation its meta came from.
        self._tl.fresh = (pid, part)
        self._tl.inc = (pid, part.inc)
        return part.meta

    def _chunks(self, pid: str) -> list[ChunkRef]:
        fresh, self._tl.fresh = getattr(self._tl, "fresh", None), None
        part = fresh[1] if fresh is not None and fresh[0] == pid else self._fetch(pid)
        return part.chunks()

    def _list(self) -> list[str]:
        self._check_cluster("listing partitions")
        keys = list_keys(self._admin, PREFIX)
        return [k[len(PREFIX):-len("/meta")] for k in keys if k.endswith("/meta") and k.count("/") == 2]

    @contextlib.contextmanager
    def _locked(self, pid: str, *, drop: bool = False) -> Iterator[None]:
        """Hold the partition lock: a put session on the lock key, never published, revoked on release.

        Another client's session start answers -705 (this client's, from another thread: -600), so the
        reservation is the lock, at two master RPCs and no transfer. The master discards a session left
        open by a dead process after put_start_discard_timeout_sec (30 s by default): stale locks break
        themselves, with no clocks compared and no race between two breakers."""
        key, delay = self._lock_key(pid), 0.0005
        deadline = time.monotonic() + self.lock_timeout_s
        while True:
            code = self._client.batch_put_session_start([key], [1], self._pin)[0]
            if code == OK:
                break
            if code == NO_AVAILABLE_HANDLE and drop:  # a full store must still be able to free memory
                log.warning("partition %s: dropping without its lock (the store is full)", pid)
                yield
                return
            if code not in (OBJECT_ALREADY_EXISTS, INVALID_PARAMS):
                raise self._error(code, f"partition {pid}: taking its lock {key}")
            if time.monotonic() > deadline:
                raise StoreUnavailableError(f"partition {pid}: its lock {key} has been held for over "
                                            f"{self.lock_timeout_s:.0f}s; is a writer stuck? (the master frees the lock "
                                            "of a dead one after its put_start_discard_timeout_sec)")
            time.sleep(delay)
            delay = min(2 * delay, 0.02)
        try:
            yield
        finally:
            with contextlib.suppress(Exception):  # after a commit nothing may raise; a lost lock only delays others
                self._client.batch_put_session_revoke([key])

    def _commit(self, pid: str, refs: list[ChunkRef]) -> None:
        """Win the next refs slot. Slot n is written put-if-absent, so the put session that reserves it
        shuts out every other writer of slot n, and a writer aims at slot n only after reading slots
        0..n-1, against which it checks conflicts: the reservation is the partition's commit lock, at no
        extra call. The first try uses the refs read when the put began (the base checked them); the
        incarnation's marker is checked in the same call, which catches a drop meanwhile."""
        inc = self._inc_of(refs[0].key)
        payload = json.dumps({"inc": inc, "refs": [r.to_json() for r in refs]}).encode()
        deadline, stuck_at = time.monotonic() + self.lock_timeout_s, -1
        part = self._parts.get(pid)
        if part is None or part.inc != inc:
            part = self._fetch(pid)
        while True:
            if part.inc != inc:
                raise self._not_found(pid, "was dropped while this put was writing (nothing was written)")
            n = part.count
            err = self._conflicts(part.meta, part.chunks(n), refs)
            if err:
                raise err
            key = self._refs_key(pid, n)
            code = self._put_if_absent(key, payload, must_exist=self._marker_key(pid, inc))
            if code == OK:
                self._tl.committed = {r.key for r in refs}
                part.refs[n] = list(refs)
                return
            if code == OBJECT_NOT_FOUND:
                raise self._not_found(pid, "was dropped while this put was writing (nothing was written)")
            if stuck_at == n:  # taken on the last pass too, yet not published for this incarnation
                left = self._get_small([key])[0]
                if left is not None and json.loads(left)["inc"] != inc:
                    self._client.remove(key, True)  # left by an earlier partition of this id (a drop meanwhile)
                elif time.monotonic() > deadline:  # reserved by a writer that died inside its put session
                    raise StoreUnavailableError(f"partition {pid}: refs key {key} stayed reserved for "
                                                f"{self.lock_timeout_s:.0f}s; retry the put later")
                else:
                    time.sleep(0.002)  # another writer is publishing it
            stuck_at = n
            part = self._fetch(pid)  # another writer's commit: read it, re-check conflicts, aim at the next slot

    # -- chunks ------------------------------------------------------------------------------------
    def _encode(self, pid: str, name: str, array: pa.Array, rows: np.ndarray) -> tuple[ChunkRef, Any]:
        """Serialize straight into this thread's registered arena (one copy), right after the previous chunk
        of the put: consecutive chunks form one object (`_flush` stores it); the ref's key is
        `<object key>@<offset>`."""
        batch = pa.record_batch([array], names=[name])
        objects = self._pending()
        used = _align(objects[-1].end) if objects else 0
        arena = self._buffer("arena", self._arena_bytes)
        size = _write_at(arena, used, batch)
        if size is None:  # the arena is full: store what it holds, then start again at 0
            self._flush(pid)
            objects, used = self._pending(), 0
            size = _write_at(arena, 0, batch)
            if size is None:  # bigger than the whole arena: grow it
                mock = pa.MockOutputStream()
                _write_ipc(mock, batch)
                arena = self._buffer("arena", mock.size())
                size = _write_at(arena, 0, batch)
        if not objects or used + size - objects[-1].start > PACK_BYTES:
            tl_pid, inc = self._tl.inc
            assert tl_pid == pid, "put() reads the partition meta before encoding"
            objects.append(_Object(f"{PREFIX}{pid}/c/{inc}/{uuid.uuid4().hex}", used))
        obj = objects[-1]
        obj.end = used + size
        obj.chunks.append((name, rows, size))
        key = f"{obj.key}@{used - obj.start}"
        return ChunkRef(name, rows, key, size, checksum(arena.array[used:used + size])), None

    def _pending(self) -> list[_Object]:
        """This thread's objects of encoded chunks, not yet stored."""
        if not hasattr(self._tl, "pending"):
            self._tl.pending = []
        return self._tl.pending

    def _flush(self, pid: str) -> None:
        """Store this thread's pending objects: reserve, fill and publish them as put sessions (hard-pinned),
        at most MAX_KEYS_PER_BATCH keys a call (bigger batches can wedge Mooncake's TCP transport)."""
        objects, self._tl.pending = self._pending(), []
        if not objects:
            return
        arena = self._buffer("arena", 0)
        keys = [o.key for o in objects]
        codes: list[int] = []
        for s in _batches(len(keys)):
            codes += self._client.batch_put_session_start(keys[s], [o.end - o.start for o in objects[s]], self._pin)
        bad = [(o, c) for o, c in zip(objects, codes) if c != OK]
        if bad:
            held = [k for k, c in zip(keys, codes) if c == OK]
            with contextlib.suppress(Exception):
                for s in _batches(len(held)):
                    self._client.batch_put_session_revoke(held[s])
            code = next((c for _, c in bad if c == NO_AVAILABLE_HANDLE), bad[0][1])
            chunks = [c for o, _ in bad for c in o.chunks]
            cols = ", ".join(sorted({name for name, _, _ in chunks}))
            rows = format_rows(np.unique(np.concatenate([r for _, r, _ in chunks])))
            raise self._error(code, f"partition {pid} put rows {rows}: {len(chunks)} chunks "
                                    f"({sum(n for _, _, n in chunks)} bytes, columns {cols}) could not be stored, so "
                                    "nothing was written")
        self._fill([(o.key, arena.ptr + o.start, o.end - o.start) for o in objects], f"partition {pid} put: storing chunks")

    def _write_chunks(self, pid: str, chunks: list[tuple[ChunkRef, Any]]) -> None:
        self._flush(pid)

    def _discard(self, pid: str, refs: list[ChunkRef]) -> None:
        self._tl.pending = []
        # an interrupt that lands just after the commit must not delete committed chunks
        keep = getattr(self._tl, "committed", set())
        keys = list(dict.fromkeys(_split(r.key)[0] for r in refs if r.key not in keep))
        with contextlib.suppress(Exception):
            for s in _batches(len(keys)):
                self._client.batch_remove(keys[s], True)

    def _read_chunks(self, pid: str, refs: list[ChunkRef]) -> list[Any]:
        """One ranged read (`get_into_ranges`) of the refs' byte ranges of their objects, into a registered
        landing buffer."""
        offsets = np.concatenate([[0], np.cumsum([_align(r.nbytes) for r in refs])]).tolist()
        lease = self._pool.take(int(offsets[-1]))
        base = lease.buf.ptr
        by_object: dict[str, list[int]] = {}
        for i, r in enumerate(refs):
            by_object.setdefault(_split(r.key)[0], []).append(i)
        codes = [0] * len(refs)
        groups = list(by_object.items())
        for s in _batches(len(groups)):
            part = groups[s]
            got = self._client.get_into_ranges(
                [base], [[k for k, _ in part]], [[[offsets[i] for i in idx] for _, idx in part]],
                [[[_split(refs[i].key)[1] for i in idx] for _, idx in part]], [[[refs[i].nbytes for i in idx] for _, idx in part]])
            for (_, idx), results in zip(part, got[0]):
                for i, c in zip(idx, results):
                    codes[i] = c
        bad = [(r, c) for r, c in zip(refs, codes) if c < 0]
        if bad:
            self._read_failed(pid, bad)
        # size/checksum mismatches are reported by the base's check of each payload
        return [pa.foreign_buffer(base + o, c, base=lease) for o, c in zip(offsets, codes)]

    def _read_failed(self, pid: str, bad: list[tuple[ChunkRef, int]]) -> None:
        ref, code = next((b for b in bad if b[1] == TRANSFER_FAIL), bad[0])
        missing = code in (OBJECT_NOT_FOUND, INVALID_PARAMS)  # -600: the range is past the object's end
        what = (f"partition {pid} column '{ref.column}' rows {format_rows(ref.rows)}: stored chunk {ref.key} is "
                f"{'missing' if missing else 'unreadable'} ({error_name(code)})")
        if len(bad) > 1:
            what += f" (and {len(bad) - 1} more chunk(s))"
        self._check_cluster(what)
        part = self._fetch(pid)  # PartitionNotFoundError if dropped meanwhile
        if part.inc != self._inc_of(ref.key):
            raise self._not_found(pid, "was dropped while reading")
        if missing:
            raise CorruptChunkError(f"{what}: data died with its holder or was removed; regenerate the step")
        if code == TRANSFER_FAIL:
            raise StoreUnavailableError(f"{what}: the holder of its bytes is unreachable, so data died with its holder; "
                                        "restart the store and regenerate the step")
        raise self._error(code, what)

    def _drop(self, pid: str) -> None:
        with self._locked(pid, drop=True):
            self._fetch(pid)  # PartitionNotFoundError if unknown
            # everything but the lock, which we hold; orphans of writers that died go too
            n = self._client.remove_by_regex(f"^{re.escape(PREFIX + pid)}/(?!lock$).*", True)
            if n < 0:
                raise self._error(n, f"dropping partition {pid}")
            self._parts.pop(pid, None)

    def _close(self) -> None:
        self._pool.close()
        with self._buffers_lock:
            for b in self._buffers:
                b.release()
            self._buffers.clear()
        self._parts.clear()
        with contextlib.suppress(Exception):
            self._client.close()  # about 1 s
        if self._owns_cluster and self.cluster is not None:
            self.cluster.close()

    # -- tests -----------------------------------------------------------------------------------
    def _corrupt_for_test(self, pid: str, ref: ChunkRef, lose: bool = False) -> None:
        """Flip one stored byte of `ref`'s chunk (upsert replaces, unlike put), or lose it with the chunks
        after it in its object (the object is cut at the chunk)."""
        key, off = _split(ref.key)
        size = self._client.get_size(key)
        buf = self._buffer("catalog", size)
        assert self._client.batch_get_into([key], [buf.ptr], [size]) == [size]
        if lose:
            size = off
            self._client.remove(key, True)
            if not size:
                return
        else:
            buf.array[off + ref.nbytes // 2] ^= 0xFF
        assert self._client.batch_upsert_from([key], [buf.ptr], [size], self._pin) == [OK]
