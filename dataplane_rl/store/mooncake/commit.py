"""A Mooncake put's commit: its objects stored with the commit record in the same calls when it can (storage.py, catalog.py).

`commit_put` first reads what other writers committed since this process last looked (one call, nothing if
none) and checks the put against it. A put then reserves its block objects and, in the same `batch_put_session_start`, the next refs slot and the
check that its incarnation's marker still exists; one `batch_put_from_multi_buffer_ranges` fills blocks
and record; one `batch_put_session_end` publishes the blocks and, only once they all are, a second one the
record: so a reader that sees the record can read every block (all or nothing), at four calls for the
whole put. If another writer holds that slot, the blocks are stored alone and the commit goes the long way
(catalog.commit). Answers a loaded store gives transiently are put again (retry.py).
"""

from __future__ import annotations

import contextlib
from typing import NamedTuple

import numpy as np

from dataplane_rl.errors import format_rows
from dataplane_rl.store.chunks import ChunkRef, PartitionMeta, Snapshot
from dataplane_rl.store.mooncake.buffers import Arenas
from dataplane_rl.store.mooncake.catalog import Catalog, batches, marker_key
from dataplane_rl.store.mooncake.client import (
    INVALID_PARAMS,
    NO_AVAILABLE_HANDLE,
    OBJECT_ALREADY_EXISTS,
    OK,
    TRANSFER_FAIL,
)
from dataplane_rl.store.mooncake.retry import Retries
from dataplane_rl.store.storage import Conflict, Staged


class Record(NamedTuple):
    """A commit record to put with the blocks: its slot's key, the marker that must exist, its bytes."""

    key: str
    marker: str
    address: int
    size: int


def commit_put(cat: Catalog, arenas: Arenas, meta: PartitionMeta, staged: Staged, conflict: Conflict) -> None:
    """Store the objects `staged.pending` ((key, address, size) each, laid out in this thread's arena) and commit
    `staged.refs`, in the same calls when the next slot is free; else store the objects alone and commit the
    long way (catalog.commit). Without objects to store, just the long way."""
    pid, refs = meta.pid, staged.refs
    check = lambda part: conflict(Snapshot(part.meta, part.refs), refs)  # noqa: E731
    if staged.pending is None:
        cat.commit(meta, refs, check)
        return
    part = cat.known(pid, meta.token)
    if part.inc != meta.token:
        raise cat.not_found(pid, "was dropped while this put was writing (nothing was written)")
    cat.catch_up(pid, part)
    err = check(part)
    if err:
        raise err
    n = part.puts
    key, payload = cat.record(pid, part, refs)
    buf = arenas.get("record", len(payload))
    buf.array[:len(payload)] = np.frombuffer(payload, dtype=np.uint8)
    if put_objects(cat, pid, staged.pending, refs, Record(key, marker_key(pid, part.inc), buf.ptr, len(payload))):
        cat.appended(part, n, refs)
        return
    cat.commit(meta, refs, check, checked=n)  # checked against slots 0..n-1 above


def put_objects(cat: Catalog, pid: str, objects: list[tuple[str, int, int]], refs: list[ChunkRef],
                record: Record | None = None) -> bool:
    """Reserve, fill and publish `objects` ((key, address, size) each), and `record` after them in the same
    calls if its slot is free: True if the record was published (the put is committed)."""
    retries = None
    while True:
        held = reserve(cat, pid, objects, refs, record)
        items = objects + ([(record.key, record.address, record.size)] if held else [])
        again = set(cat.fill(items, f"partition {pid} put: storing blocks", last=record.key if held else None))
        objects = [o for o in objects if o[0] in again]
        if not objects:
            return held and record.key not in again
        record = None  # some blocks go again: the record waits for them, and commits the long way
        retries = retries or Retries.uncounted(cat.check)  # fill() counted them
        if not retries.again(TRANSFER_FAIL, f"partition {pid} put: storing blocks"):
            raise cat.error(TRANSFER_FAIL, f"partition {pid} put: storing blocks {objects[0][0]}..")


def reserve(cat: Catalog, pid: str, objects: list[tuple[str, int, int]], refs: list[ChunkRef],
            record: Record | None) -> bool:
    """Reserve the objects (an error, nothing left reserved, if one cannot be) and the record's slot; True
    if the slot is ours. A missing marker (the partition was dropped) is PartitionNotFoundError."""
    keys = [k for k, _, _ in objects]
    sizes = [n for _, _, n in objects]
    if record is not None:
        keys, sizes = keys + [record.key, record.marker], sizes + [record.size, 1]
    codes: list[int] = []
    for s in batches(len(keys)):
        codes += cat.client.batch_put_session_start(keys[s], sizes[s], cat.pin)
    n = len(objects)
    dropped = record is not None and codes[n + 1] == OK  # we reserved the marker: it was not there
    bad = [c for c in codes[:n] if c != OK]
    if bad or dropped:
        held = [k for k, c in zip(keys, codes) if c == OK]
        with contextlib.suppress(Exception):
            for s in batches(len(held)):
                cat.client.batch_put_session_revoke(held[s])
        if dropped:
            raise cat.not_found(pid, "was dropped while this put was writing (nothing was written)")
        code = next((c for c in bad if c == NO_AVAILABLE_HANDLE), bad[0])
        cols = ", ".join(refs[0].columns) if refs else ""
        rows = format_rows(np.unique(np.concatenate([r.rows for r in refs]))) if refs else ""
        raise cat.error(code, f"partition {pid} put rows {rows}: {len(refs)} blocks "
                              f"({sum(sizes[:n])} bytes, columns {cols}) could not be stored, so nothing was written")
    if record is None:
        return False
    if codes[n + 1] not in (OBJECT_ALREADY_EXISTS, INVALID_PARAMS):
        raise cat.error(codes[n + 1], f"checking catalog key {record.marker}")
    return codes[n] == OK
