"""The storage of a `mooncake://` store (docs/architecture.md §5.4): columns in the Mooncake distributed store.

Its URL is always the master's address, so other processes (Ray actors, readers, the CLI) open the same store
as clients, which never start or stop anything and contribute no memory: data outlives every client.

Keys (a few per put, never one per cell or sample: over TCP Mooncake costs ~100 us per key): the
catalog's (catalog.py), and `dprl/<pid>/c/<inc>/<id>`, the blocks of one put (up to PACK_BYTES): each
every column of the put for a row block as flat buffers (chunks.py), at a 64-byte-aligned offset; a
ChunkRef's key is `<object>@<offset>`.

Put: blocks are serialized straight into a registered arena (one copy), back to back. The commit reads
what other writers committed since this process last looked (one batched read; nothing when there is
nothing), checks conflicts, and stores blocks and commit record together (commit.py): one
`batch_put_session_start` reserves every block object and the next refs slot r/<inc>/<n>, one
`batch_put_from_multi_buffer_ranges` fills them, one `batch_put_session_end` publishes the blocks and a
second the record. If another writer took the slot, the blocks go alone and the record takes the next free
slot (catalog.py). A put starts from the refs this process has cached (no catalog read before it).
Get: refs are cached per process; a known partition is checked with one master RPC (`batch_is_exist` of
the marker and the next slots: no data moves), new slots read with one `batch_get_into`; then one
`get_into_ranges` reads just the chunks' byte ranges into a registered buffer that the returned Arrow
arrays keep alive (reused once they are gone). Keys are never listed on the data path: `/get_all_keys`
over the admin HTTP port serves list_partitions only. Nothing holds a lock: a transient answer of a
loaded store (a read's lease that ran out, a holder slow to answer, a reservation the master discarded)
is retried within a deadline and counted in `dataplane_store_retries_total` (retry.py).

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
- a put session left open by a dead process blocks its key until the next put_start of that key after
  put_start_discard_timeout_sec (30 s by default): only a refs slot can be left so, and a commit waits for it.
"""

from __future__ import annotations

import contextlib
from typing import Callable
from urllib.parse import urlencode

import numpy as np
import pyarrow as pa

from dataplane_rl.errors import (
    CorruptChunkError,
    DataPlaneError,
    PartitionExistsError,
    PartitionNotFoundError,
    StoreUnavailableError,
    format_rows,
)
from dataplane_rl.store import chunks
from dataplane_rl.store.chunks import Block, ChunkRef, PartitionMeta, Snapshot, align, layout, split_key
from dataplane_rl.store.mooncake.buffers import Arenas, ReadPool
from dataplane_rl.store.mooncake.catalog import Catalog, batches, block_object_key, inc_of
from dataplane_rl.store.mooncake.client import (
    INVALID_PARAMS,
    MIN_SEGMENT_SIZE,
    OBJECT_NOT_FOUND,
    TRANSFER_FAIL,
    connect_client,
    default_admin_address,
    error_name,
    no_eviction_config,
)
from dataplane_rl.store.mooncake.cluster import MooncakeCluster
from dataplane_rl.store.mooncake.commit import commit_put
from dataplane_rl.store.mooncake.health import Health
from dataplane_rl.store.mooncake.retry import READ_TRANSIENT, Retries
from dataplane_rl.store.storage import Conflict, Staged, Storage

# Blocks of one put are stored as objects of up to this size: measured, one 5.7 MB object takes ~30% less
# time to store than 13 of ~0.5 MB (the cost per key), while a cap lets a big put spread over holders
# (Mooncake never splits an object across segments) and fits the smallest segment Mooncake allows.
PACK_BYTES = MIN_SEGMENT_SIZE
CLIENT_ARENA_BYTES = 32 << 20


class MooncakeStorage(Storage):
    """A Mooncake client, its registered buffers and the catalog; the cluster too, when the store started it."""

    def __init__(self, address: str, admin: str, transport: dict[str, str], cluster: MooncakeCluster | None,
                 owns_cluster: bool, arena_bytes: int, retried: Callable[[], None]) -> None:
        """`transport`: the client's settings that differ from connect_client's defaults (they travel in the
        URL); `owns_cluster`: close() stops `cluster`; `retried`: counts a transient answer put again."""
        self._address, self._admin, self._transport = address, admin, transport
        self._cluster, self._owns_cluster = cluster, owns_cluster
        # The copying calls (get/put) are not used, so the client's own transfer buffer stays empty;
        # the registered arenas below are sized from local_buffer_size_mb instead.
        self._client = connect_client(address, 0, **transport)
        self._arena_bytes = arena_bytes
        self._pin = no_eviction_config()  # hard pin: never evicted, even by a master that evicts
        self._pool = ReadPool(self._client, arena_bytes)
        self._arenas = Arenas(self._client)
        self._health = Health(cluster, address, self._admin)
        self._catalog = Catalog(self._client, self._pin, self._arenas, self._admin, self._check_cluster, self._error,
                                self.not_found, retried)

    @property
    def url(self) -> str:
        query = dict(self._transport)
        if self._admin != default_admin_address(self._address):
            query["admin"] = self._admin
        return f"mooncake://{self._address}" + ("?" + urlencode(query) if query else "")

    @property
    def catalog(self) -> Catalog:
        return self._catalog

    def _check_cluster(self, where: str) -> None:
        self._health.check(where)

    def not_found(self, pid: str, why: str = "is unknown or dropped") -> DataPlaneError:
        """A partition that is not there, unless a holder this store saw is gone with it (health.py)."""
        return self._lost(pid, f"partition {pid} {why} in {self.url}, and") or super().not_found(pid, why)

    def unwritten(self, pid: str, err: DataPlaneError) -> DataPlaneError:
        """Cells that look unwritten, unless a holder this store saw is gone: the master drops a dead holder's
        keys, a commit's slot in the catalog too, so the rows that commit wrote look never written."""
        return self._lost(pid, f"{err}; but") or err

    def _lost(self, pid: str, said: str) -> StoreUnavailableError | None:
        """The error naming the holder segments this store saw that are gone, after `said`; None if none is."""
        self._health.check(f"partition {pid}")
        lost = self._health.lost()
        if not lost:
            return None
        return StoreUnavailableError(f"{said} the holder segment(s) {', '.join(lost)} this store saw are no longer "
                                     "mounted: its data died with its holder; restart the store and regenerate the step")

    def _error(self, code: int, what: str) -> StoreUnavailableError:
        return self._health.error(code, what, self.url)

    # -- catalog ---------------------------------------------------------------------------------
    def create(self, meta: PartitionMeta) -> None:
        if not self._catalog.create(meta):
            raise PartitionExistsError(f"partition {meta.pid} already exists in {self.url}; drop it first or use a new id")

    def snapshot(self, pid: str) -> Snapshot:
        part = self._catalog.fetch(pid)
        return Snapshot(part.meta, part.refs)

    def known_snapshot(self, pid: str) -> Snapshot | None:
        """The refs this process has cached: a put starts from them (no read), and its commit reads the slots
        committed since and checks against them exactly (commit.py)."""
        part = self._catalog.parts.get(pid)
        return None if part is None else Snapshot(part.meta, part.refs)

    def list(self) -> list[str]:
        return self._catalog.list()

    def commit(self, meta: PartitionMeta, staged: Staged, seen: list[ChunkRef], conflict: Conflict) -> None:
        """Store the blocks `store` laid out in this thread's arena and commit them (commit.py)."""
        commit_put(self._catalog, self._arenas, meta, staged, conflict)

    def drop(self, pid: str) -> None:
        self._catalog.drop(pid)  # orphans of writers that died go too: every key of the incarnation

    # -- blocks ----------------------------------------------------------------------------------
    def store(self, meta: PartitionMeta, blocks: list[Block]) -> Staged:
        """Serialize every block straight into this thread's registered arena (one copy), packed into
        objects of up to PACK_BYTES; `commit` stores them (hard-pinned put sessions) with the record."""
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
        # stored by `commit`, in the same calls as the commit record: nothing is stored before the commit
        return Staged(refs, [(key, arena.ptr + start, end) for key, start, end, _ in plans])

    def discard(self, meta: PartitionMeta, refs: list[ChunkRef]) -> None:
        try:  # an interrupt that lands just after the commit must not delete committed blocks
            keep = {r.key for r in self._catalog.fetch(meta.pid).refs}
        except Exception:
            keep = set()
        keys = list(dict.fromkeys(split_key(r.key)[0] for r in refs if r.key not in keep))
        with contextlib.suppress(Exception):
            for s in batches(len(keys)):
                self._client.batch_remove(keys[s], True)

    def read(self, pid: str, refs: list[ChunkRef]) -> list[pa.Buffer]:
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
        retries = self._catalog.retries()
        for s in batches(len(groups)):
            self._read_ranges(base, groups[s], refs, offsets, codes, retries, pid)
        bad = [(r, c) for r, c in zip(refs, codes) if c < 0]
        if bad:
            self._read_failed(pid, bad, holder_lost=TRANSFER_FAIL in retries.seen)
        # size/checksum mismatches are reported by the base's check of each payload
        return [pa.foreign_buffer(base + o, c, base=lease) for o, c in zip(offsets, codes)]

    def _read_ranges(self, base: int, part, refs: list[ChunkRef], offsets: list[int], codes: list[int],
                     retries: Retries, pid: str) -> None:
        """One get_into_ranges of these objects' ranges; read again while a range's answer is transient."""
        while True:
            got = self._client.get_into_ranges(
                [base], [[k for k, _ in part]], [[[offsets[i] for i in idx] for _, idx in part]],
                [[[split_key(refs[i].key)[1] for i in idx] for _, idx in part]],
                [[[refs[i].nbytes for i in idx] for _, idx in part]])
            slow = None
            for (_, idx), results in zip(part, got[0]):
                for i, c in zip(idx, results):
                    codes[i] = c
                    slow = c if c in READ_TRANSIENT else slow
            if slow is None or not retries.again(slow, f"partition {pid}: reading stored blocks {part[0][0]}.."):
                return

    def _read_failed(self, pid: str, bad: list[tuple[ChunkRef, int]], holder_lost: bool = False) -> None:
        """The error for blocks a read could not get. `holder_lost`: a holder stopped answering during the read
        (TRANSFER_FAIL, retried): keys that are gone after that went with it, not with a drop (a drop's keys
        answer OBJECT_NOT_FOUND at once), even when the partition's catalog keys went too."""
        ref, code = next((b for b in bad if b[1] == TRANSFER_FAIL), bad[0])
        missing = code in (OBJECT_NOT_FOUND, INVALID_PARAMS)  # -600: the range is past the object's end
        cols = ", ".join(f"'{c}'" for c in ref.columns)
        what = (f"partition {pid} column(s) {cols} rows {format_rows(ref.rows)}: stored block {ref.key} is "
                f"{'missing' if missing else 'unreadable'} ({error_name(code)})")
        if len(bad) > 1:
            what += f" (and {len(bad) - 1} more block(s))"
        self._check_cluster(what)
        try:
            part = self._catalog.fetch(pid)  # PartitionNotFoundError if dropped meanwhile
        except PartitionNotFoundError:
            if holder_lost:
                raise StoreUnavailableError(f"{what}: its holder stopped answering (TRANSFER_FAIL) and then the "
                                            f"partition's keys were gone, so data died with its holder; restart "
                                            "the store and regenerate the step") from None
            if pid not in self._catalog.list():  # dropped; else its catalog keys died with a holder too
                raise
            raise CorruptChunkError(f"{what}: data died with its holder or was removed; regenerate the step") from None
        if part.inc != inc_of(ref.key):
            raise self.not_found(pid, "was dropped while reading")
        if missing:
            raise CorruptChunkError(f"{what}: data died with its holder or was removed; regenerate the step")
        if code == TRANSFER_FAIL:
            raise StoreUnavailableError(f"{what}: the holder of its bytes is unreachable, so data died with its holder; "
                                        "restart the store and regenerate the step")
        raise self._error(code, what)

    def forget(self, pid: str) -> None:
        self._catalog.parts.pop(pid, None)

    def close(self) -> None:
        self._pool.close()
        self._arenas.close()
        self._catalog.parts.clear()
        with contextlib.suppress(Exception):
            self._client.close()  # about 1 s
        if self._owns_cluster and self._cluster is not None:
            self._cluster.close()
