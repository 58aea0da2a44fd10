"""`mooncake://[HOST:PORT]`: columns in the Mooncake distributed store, for more than one machine (docs/architecture.md §5.4).

`mooncake://` starts a cluster of its own (a master and `num_holders` holder processes on free 127.0.0.1
ports, see MooncakeCluster) and stops it on close(); `store.cluster` is that cluster. `mooncake://HOST:PORT`
joins a running master as a pure client. The master's admin HTTP server is taken to be on PORT+1 (true
for masters MooncakeCluster starts); name another with `mooncake://HOST:PORT?admin=HOST:Q`. `store.url`
is always the master's address, so other processes (Ray actors, readers, the CLI) open the same store as
clients, which never start or stop anything and contribute no memory: data outlives every client.

Keys (a few per put, never one per cell or sample: over TCP Mooncake costs ~100 us per key): the
catalog's (catalog.py), and `dprl/<pid>/c/<inc>/<id>`, the blocks of one put (up to PACK_BYTES): each
every column of the put for a row block as flat buffers (chunks.py), at a 64-byte-aligned offset; a
ChunkRef's key is `<object>@<offset>`.

Put: blocks are serialized straight into a registered arena (one copy), back to back, and stored with one
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
import re
from typing import Any
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
from dataplane_rl.store import chunks
from dataplane_rl.store.base import ColumnStore
from dataplane_rl.store.chunks import Block, ChunkRef, PartitionMeta, Snapshot, align, layout, split_key
from dataplane_rl.store.mooncake.buffers import Arenas, ReadPool
from dataplane_rl.store.mooncake.catalog import PREFIX, Catalog, batches, block_object_key, inc_of
from dataplane_rl.store.mooncake.client import (
    INVALID_PARAMS,
    MIN_SEGMENT_SIZE,
    NO_AVAILABLE_HANDLE,
    OBJECT_NOT_FOUND,
    OK,
    RPC_FAIL,
    TRANSFER_FAIL,
    connect_client,
    default_admin_address,
    error_name,
    import_mooncake_store,
    no_eviction_config,
    split_address,
)
from dataplane_rl.store.mooncake.cluster import MooncakeCluster

# Blocks of one put are stored as objects of up to this size: measured, one 5.7 MB object takes ~30% less
# time to store than 13 of ~0.5 MB (the cost per key), while a cap lets a big put spread over holders
# (Mooncake never splits an object across segments) and fits the smallest segment Mooncake allows.
PACK_BYTES = MIN_SEGMENT_SIZE
CLIENT_ARENA_BYTES = 32 << 20
_TRANSPORT_DEFAULTS = {k: p.default for k, p in inspect.signature(connect_client).parameters.items()
                       if k in ("protocol", "device_name", "metadata_server", "local_hostname")}


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
        self._pool = ReadPool(self._client, self._arena_bytes)
        self._arenas = Arenas(self._client)
        self._catalog = Catalog(self._client, self._pin, self._arenas, self._admin, self._check_cluster, self._error,
                                self._not_found)

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

    @property
    def lock_timeout_s(self) -> float:
        return self._catalog.lock_timeout_s

    @lock_timeout_s.setter
    def lock_timeout_s(self, value: float) -> None:
        self._catalog.lock_timeout_s = value

    # -- errors ----------------------------------------------------------------------------------
    def processes(self) -> list[dict]:
        c = self.cluster
        return [] if c is None or c.master is None else (
            [{"process": "master", "pid": c.master.pid, "node": c.host}]
            + [{"process": "holder", "index": h.index, "pid": h.pid, "node": c.host} for h in c.holders])

    def dead_processes(self) -> list[str] | None:
        return None if self.cluster is None else self.cluster.dead()

    def stop_processes(self) -> None:
        if self.cluster is not None:
            self.cluster.close()

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

    # -- catalog hooks -------------------------------------------------------------------------------
    def _create(self, meta: PartitionMeta) -> None:
        if not self._catalog.create(meta):
            raise PartitionExistsError(f"partition {meta.pid} already exists in {self.url}; drop it first or use a new id")

    def _snapshot(self, pid: str) -> Snapshot:
        part = self._catalog.fetch(pid)
        return Snapshot(part.meta, part.refs)

    def _list(self) -> list[str]:
        return self._catalog.list()

    def _commit(self, meta: PartitionMeta, refs: list[ChunkRef], seen=None) -> None:
        self._catalog.commit(meta, refs, lambda part: self._conflict(Snapshot(part.meta, part.refs), refs))

    def _drop(self, pid: str) -> None:
        with self._catalog.locked(pid, drop=True):
            self._catalog.fetch(pid)  # PartitionNotFoundError if unknown
            # everything but the lock, which we hold; orphans of writers that died go too
            n = self._client.remove_by_regex(f"^{re.escape(PREFIX + pid)}/(?!lock$).*", True)
            if n < 0:
                raise self._error(n, f"dropping partition {pid}")
            self._catalog.parts.pop(pid, None)

    # -- blocks ----------------------------------------------------------------------------------
    def _store(self, meta: PartitionMeta, blocks: list[Block]) -> list[ChunkRef]:
        """Serialize every block straight into this thread's registered arena (one copy), packed into
        objects of up to PACK_BYTES, then store all objects as put sessions (hard-pinned): reserve, fill
        and publish, one call each for the whole put."""
        groups: list[list[int]] = [[]]  # block indices per object
        size = 0
        for i, block in enumerate(blocks):
            n = block.nbytes
            if groups[-1] and size + n > PACK_BYTES:
                groups.append([])
                size = 0
            groups[-1].append(i)
            size = align(size + n)
        plans = []  # (object key, arena start, size, [block offsets])
        at = 0
        for g in groups:
            offsets, end = layout([blocks[i] for i in g])
            plans.append((block_object_key(meta.pid, meta.token), at, end, offsets))
            at = align(at + end)
        arena = self._arenas.get("arena", max(at, self._arena_bytes))
        refs: list[ChunkRef] = []
        for (key, start, _, offsets), g in zip(plans, groups):
            for i, off in zip(g, offsets):
                block, at = blocks[i], start + off
                digests = chunks.write_block(arena.array[at:at + block.nbytes], block)
                refs.append(ChunkRef.of(block, f"{key}@{off}", digests))
        self._put_objects(meta.pid, [(key, arena.ptr + start, end) for key, start, end, _ in plans], refs)
        return refs

    def _put_objects(self, pid: str, objects: list[tuple[str, int, int]], refs: list[ChunkRef]) -> None:
        keys = [k for k, _, _ in objects]
        codes: list[int] = []
        for s in batches(len(keys)):
            codes += self._client.batch_put_session_start(keys[s], [n for _, _, n in objects[s]], self._pin)
        bad = [c for c in codes if c != OK]
        if bad:
            held = [k for k, c in zip(keys, codes) if c == OK]
            with contextlib.suppress(Exception):
                for s in batches(len(held)):
                    self._client.batch_put_session_revoke(held[s])
            code = next((c for c in bad if c == NO_AVAILABLE_HANDLE), bad[0])
            cols = ", ".join(refs[0].columns) if refs else ""
            rows = format_rows(np.unique(np.concatenate([r.rows for r in refs]))) if refs else ""
            raise self._error(code, f"partition {pid} put rows {rows}: {len(refs)} blocks "
                                    f"({sum(n for _, _, n in objects)} bytes, columns {cols}) could not be stored, "
                                    "so nothing was written")
        self._catalog.fill(objects, f"partition {pid} put: storing blocks")

    def _discard(self, meta: PartitionMeta, refs: list[ChunkRef]) -> None:
        try:  # an interrupt that lands just after the commit must not delete committed blocks
            keep = {r.key for r in self._catalog.fetch(meta.pid).refs}
        except Exception:
            keep = set()
        keys = list(dict.fromkeys(split_key(r.key)[0] for r in refs if r.key not in keep))
        with contextlib.suppress(Exception):
            for s in batches(len(keys)):
                self._client.batch_remove(keys[s], True)

    def _read(self, pid: str, refs: list[ChunkRef]) -> list[pa.Buffer]:
        """One ranged read (`get_into_ranges`) of the refs' byte ranges of their objects, into a registered
        landing buffer."""
        offsets = np.concatenate([[0], np.cumsum([align(r.nbytes) for r in refs])]).tolist()
        lease = self._pool.take(int(offsets[-1]))
        base = lease.buf.ptr
        by_object: dict[str, list[int]] = {}
        for i, r in enumerate(refs):
            by_object.setdefault(split_key(r.key)[0], []).append(i)
        codes = [0] * len(refs)
        groups = list(by_object.items())
        for s in batches(len(groups)):
            part = groups[s]
            got = self._client.get_into_ranges(
                [base], [[k for k, _ in part]], [[[offsets[i] for i in idx] for _, idx in part]],
                [[[split_key(refs[i].key)[1] for i in idx] for _, idx in part]],
                [[[refs[i].nbytes for i in idx] for _, idx in part]])
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
        cols = ", ".join(f"'{c}'" for c in ref.columns)
        what = (f"partition {pid} column(s) {cols} rows {format_rows(ref.rows)}: stored block {ref.key} is "
                f"{'missing' if missing else 'unreadable'} ({error_name(code)})")
        if len(bad) > 1:
            what += f" (and {len(bad) - 1} more block(s))"
        self._check_cluster(what)
        part = self._catalog.fetch(pid)  # PartitionNotFoundError if dropped meanwhile
        if part.inc != inc_of(ref.key):
            raise self._not_found(pid, "was dropped while reading")
        if missing:
            raise CorruptChunkError(f"{what}: data died with its holder or was removed; regenerate the step")
        if code == TRANSFER_FAIL:
            raise StoreUnavailableError(f"{what}: the holder of its bytes is unreachable, so data died with its holder; "
                                        "restart the store and regenerate the step")
        raise self._error(code, what)

    def _forget(self, pid: str) -> None:
        self._catalog.parts.pop(pid, None)

    def _close(self) -> None:
        self._pool.close()
        self._arenas.close()
        self._catalog.parts.clear()
        with contextlib.suppress(Exception):
            self._client.close()  # about 1 s
        if self._owns_cluster and self.cluster is not None:
            self.cluster.close()
