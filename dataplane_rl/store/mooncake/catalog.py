"""A Mooncake store's catalog: partition metas, committed refs and the partition lock, as Mooncake keys.

    dprl/<pid>/meta          the PartitionMeta and an incarnation id <inc>; put-if-absent
    dprl/<pid>/i/<inc>       marker: this incarnation of the partition is live
    dprl/<pid>/lock          lock of create and drop: a put session, never published
    dprl/<pid>/r/<n>         the n-th committed put: {"inc", "refs": [ChunkRef...]}; put-if-absent
    dprl/<pid>/c/<inc>/<id>  blocks of one put (store.py)

Commit wins the next refs slot r/<n> with a put session (Mooncake's only atomic put-if-absent), after
checking conflicts against slots 0..n-1: whoever reserves slot n first is its only writer, so the slot is
the commit lock. Refs are cached per process; a known partition is checked with one master RPC
(`batch_is_exist` of the marker and the next slots: no data moves), a new one read with one
`batch_get_into` (meta and the first slots). A partition dropped and created again has a new <inc>:
nothing of the old one is read as the new one's.

Mooncake quirks handled here: a plain put of an existing key returns OK and keeps the old value (every
contended key is written with a put session); a put session left open by a dead process blocks its key
until the master discards it after put_start_discard_timeout_sec (30 s by default), which is what breaks
a dead writer's lock.
"""

from __future__ import annotations

import contextlib
import json
import logging
import time
import uuid
from dataclasses import dataclass, field
from typing import Callable, Iterator

import numpy as np

from dataplane_rl.errors import CorruptChunkError, StoreUnavailableError
from dataplane_rl.store.chunks import PID, ChunkRef, PartitionMeta, refs_to_json
from dataplane_rl.store.mooncake.buffers import Arenas
from dataplane_rl.store.mooncake.client import (
    INVALID_PARAMS,
    MAX_KEYS_PER_BATCH,
    NO_AVAILABLE_HANDLE,
    OBJECT_ALREADY_EXISTS,
    OBJECT_NOT_FOUND,
    OK,
    REPLICA_IS_NOT_READY,
    TRANSFER_FAIL,
    list_keys,
)

log = logging.getLogger(__name__)

PREFIX = "dprl/"
_SLOT = 64 << 10  # bytes per catalog key in one batched read; a bigger value is re-read at its size
_PROBE = 4  # refs keys asked for beyond the last one known, per catalog read (doubling up to _MAX_PROBE)
_MAX_PROBE = 64
LOCK_TIMEOUT_S = 120.0  # longer than the master's put_start_discard_timeout_sec (30 s), which frees dead locks


def batches(n: int) -> Iterator[slice]:
    """Slices of at most MAX_KEYS_PER_BATCH keys (bigger batches can wedge Mooncake's TCP transport)."""
    for lo in range(0, n, MAX_KEYS_PER_BATCH):
        yield slice(lo, min(n, lo + MAX_KEYS_PER_BATCH))


def meta_key(pid: str) -> str:
    return f"{PREFIX}{pid}/meta"


def marker_key(pid: str, inc: str) -> str:
    return f"{PREFIX}{pid}/i/{inc}"


def lock_key(pid: str) -> str:
    return f"{PREFIX}{pid}/lock"


def refs_key(pid: str, n: int) -> str:
    return f"{PREFIX}{pid}/r/{n}"


def block_object_key(pid: str, inc: str) -> str:
    return f"{PREFIX}{pid}/c/{inc}/{uuid.uuid4().hex}"


def inc_of(chunk_key: str) -> str:
    return chunk_key.split("/")[3]  # dprl/<pid>/c/<inc>/<id>@<offset>


@dataclass
class Part:
    """What this process knows of a partition: its meta (token: the incarnation) and committed refs."""

    meta: PartitionMeta
    puts: int = 0
    refs: list[ChunkRef] = field(default_factory=list)  # of puts 0..puts-1, in order; only ever appended

    @property
    def inc(self) -> str:
        return self.meta.token


class Catalog:
    """The catalog keys of one client. `error(code, what)` and `not_found(pid, why)` build the store's errors."""

    def __init__(self, client, pin, arenas: Arenas, admin: str, check: Callable[[str], None],
                 error: Callable[[int, str], Exception], not_found: Callable[..., Exception]) -> None:
        self._client, self._pin, self._arenas, self._admin = client, pin, arenas, admin
        self._check, self._error, self._not_found = check, error, not_found
        self.parts: dict[str, Part] = {}
        self.lock_timeout_s = LOCK_TIMEOUT_S

    # -- small values ----------------------------------------------------------------------------
    def get_small(self, keys: list[str]) -> list[bytes | None]:
        """Values of small keys in one batch_get_into; None for a missing (or not yet published) key."""
        buf = self._arenas.get("catalog", len(keys) * _SLOT)
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
        buf = self._arenas.get("catalog", size)
        code = self._client.batch_get_into([key], [buf.ptr], [size])[0]
        if code in (OBJECT_NOT_FOUND, REPLICA_IS_NOT_READY):
            return None
        if code < 0:
            raise self._error(code, f"reading catalog key {key}")
        return buf.array[:code].tobytes()

    def put_if_absent(self, key: str, data: bytes, must_exist: str | None = None) -> int:
        """OK; OBJECT_ALREADY_EXISTS if the key exists or is being written; OBJECT_NOT_FOUND if the key
        `must_exist` does not (checked in the same call, at no cost: reserving an existing key fails).

        Mooncake quirk: a plain put of an existing key returns OK and keeps the old value; a put session
        is its one atomic put-if-absent (another client's reservation or key: -705; our own: -600)."""
        buf = self._arenas.get("catalog", len(data))
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
        self.fill([(key, buf.ptr, len(data))], f"writing catalog key {key}")
        return OK

    def fill(self, items: list[tuple[str, int, int]], what: str) -> None:
        """Fill and publish keys reserved by batch_put_session_start ((key, address, size) each); on any
        failure revoke every reservation not yet published and raise."""
        keys = [k for k, _, _ in items]
        ended: set[str] = set()
        try:
            for s in batches(len(items)):
                part = items[s]
                wrote = self._client.batch_put_from_multi_buffer_ranges(
                    keys[s], [[p] for _, p, _ in part], [[n] for _, _, n in part], [[0]] * len(part))
                bad = next(((w, n) for w, (_, _, n) in zip(wrote, part) if w != n), None)
                if bad is not None:
                    raise self._error(bad[0] if bad[0] < 0 else TRANSFER_FAIL, f"{what} ({bad[0]} of {bad[1]} bytes)")
            for s in batches(len(items)):
                codes = self._client.batch_put_session_end(keys[s])
                ended.update(k for k, c in zip(keys[s], codes) if c == OK)
                bad = next((c for c in codes if c != OK), None)
                if bad is not None:
                    raise self._error(bad, what)
        except BaseException:
            with contextlib.suppress(Exception):
                left = [k for k in keys if k not in ended]
                for s in batches(len(left)):
                    self._client.batch_put_session_revoke(left[s])
            raise

    # -- partitions ------------------------------------------------------------------------------
    def fetch(self, pid: str) -> Part:
        """The partition's meta and committed refs. A known partition costs one master RPC (is its
        incarnation's marker there, and any refs key after the last known?) plus one read of new refs;
        an unknown one, one read of the meta with the first refs keys."""
        if not isinstance(pid, str) or not PID.fullmatch(pid):
            raise self._not_found(pid)
        self._check(f"partition {pid}")
        part = self.parts.get(pid)
        if part is not None and self._refresh(pid, part):
            return part
        vals = self.get_small([meta_key(pid)] + [refs_key(pid, n) for n in range(_PROBE)])
        if vals[0] is None:
            self.parts.pop(pid, None)
            raise self._not_found(pid)
        doc = json.loads(vals[0])
        inc = doc.pop("incarnation")
        part = Part(PartitionMeta.from_json(json.dumps(doc), inc))
        self.parts[pid] = part
        if self._take_refs(part, vals[1:]) == _PROBE:
            self._refresh(pid, part)
        return part

    def _refresh(self, pid: str, part: Part) -> bool:
        """Read the refs keys committed since this process last looked; False if the partition is gone or
        was dropped and made again (its incarnation's marker is gone)."""
        probe = _PROBE
        while True:
            n = part.puts
            keys = [marker_key(pid, part.inc)] + [refs_key(pid, k) for k in range(n, n + probe)]
            there = self._client.batch_is_exist(keys)  # master only: no transfer
            bad = next((c for c in there if c < 0), None)
            if bad is not None:
                raise self._error(bad, f"partition {pid}: looking up catalog keys")
            if there[0] != 1:
                return False
            new = next((i for i, c in enumerate(there[1:]) if c != 1), probe)
            if new == 0 or self._take_refs(part, self.get_small(keys[1:1 + new])) < probe:
                return True
            probe = min(2 * probe, _MAX_PROBE)  # every key asked for was there: there may be many more

    @staticmethod
    def _take_refs(part: Part, values: list[bytes | None]) -> int:
        """Add the values of refs keys part.puts, part.puts+1, ... up to the first missing one; how many."""
        for i, v in enumerate(values):
            doc = json.loads(v) if v is not None else None
            if doc is None or doc["inc"] != part.inc:  # not there, or left by an earlier partition of this id
                return i
            try:
                part.refs = part.refs + [ChunkRef.from_json(d) for d in doc["refs"]]
            except (KeyError, ValueError, TypeError) as e:  # e.g. refs of the IPC-block format (before v4)
                raise CorruptChunkError(f"partition {part.meta.pid}: commit {part.puts} is not in this dataplane-rl's "
                                        f"format ({e!r}); it was written by another version: drop the partition "
                                        "and regenerate the step") from None
            part.puts += 1
        return len(values)

    def create(self, meta: PartitionMeta) -> bool:
        """Publish a new partition's meta; False if the id is taken."""
        self._check(f"partition {meta.pid}")
        inc = uuid.uuid4().hex[:12]
        text = json.dumps({**json.loads(meta.to_json()), "incarnation": inc}).encode()
        with self.locked(meta.pid):  # serialised with a drop of the same id
            marker = marker_key(meta.pid, inc)
            self.put_if_absent(marker, b"1")  # first, so every published meta has its marker
            code = None
            try:
                code = self.put_if_absent(meta_key(meta.pid), text)
            finally:
                if code != OK:
                    self._client.remove(marker, True)
        if code == OBJECT_ALREADY_EXISTS:
            return False
        self.parts[meta.pid] = Part(PartitionMeta(meta.pid, meta.schema_json, meta.num_rows, inc))
        return True

    def commit(self, meta: PartitionMeta, refs: list[ChunkRef], conflict: Callable[[Part], Exception | None]) -> None:
        """Win the next refs slot. Slot n is written put-if-absent, so the put session that reserves it
        shuts out every other writer of slot n, and a writer aims at slot n only after reading slots
        0..n-1, against which `conflict` checks: the reservation is the partition's commit lock, at no
        extra call. The incarnation's marker is checked in the same call, which catches a drop meanwhile."""
        pid, inc = meta.pid, meta.token
        payload = json.dumps({"inc": inc, "refs": json.loads(refs_to_json(refs))}).encode()
        deadline, stuck_at = time.monotonic() + self.lock_timeout_s, -1
        part = self.parts.get(pid)
        if part is None or part.inc != inc:
            part = self.fetch(pid)
        while True:
            if part.inc != inc:
                raise self._not_found(pid, "was dropped while this put was writing (nothing was written)")
            err = conflict(part)
            if err:
                raise err
            n = part.puts
            key = refs_key(pid, n)
            code = self.put_if_absent(key, payload, must_exist=marker_key(pid, inc))
            if code == OK:
                if part.puts == n:
                    part.refs = part.refs + list(refs)
                    part.puts += 1
                return
            if code == OBJECT_NOT_FOUND:
                raise self._not_found(pid, "was dropped while this put was writing (nothing was written)")
            if stuck_at == n:  # taken on the last pass too, yet not published for this incarnation
                left = self.get_small([key])[0]
                if left is not None and json.loads(left)["inc"] != inc:
                    self._client.remove(key, True)  # left by an earlier partition of this id (a drop meanwhile)
                elif time.monotonic() > deadline:  # reserved by a writer that died inside its put session
                    raise StoreUnavailableError(f"partition {pid}: refs key {key} stayed reserved for "
                                                f"{self.lock_timeout_s:.0f}s; retry the put later")
                else:
                    time.sleep(0.002)  # another writer is publishing it
            stuck_at = n
            part = self.fetch(pid)  # another writer's commit: read it, re-check conflicts, aim at the next slot

    def list(self) -> list[str]:
        self._check("listing partitions")
        keys = list_keys(self._admin, PREFIX)
        return [k[len(PREFIX):-len("/meta")] for k in keys if k.endswith("/meta") and k.count("/") == 2]

    @contextlib.contextmanager
    def locked(self, pid: str, *, drop: bool = False) -> Iterator[None]:
        """Hold the partition lock: a put session on the lock key, never published, revoked on release.

        Another client's session start answers -705 (this client's, from another thread: -600), so the
        reservation is the lock, at two master RPCs and no transfer. The master discards a session left
        open by a dead process after put_start_discard_timeout_sec (30 s by default): stale locks break
        themselves, with no clocks compared and no race between two breakers."""
        key, delay = lock_key(pid), 0.0005
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
