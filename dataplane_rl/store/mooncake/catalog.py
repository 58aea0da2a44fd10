"""A Mooncake store's catalog: partition metas and committed refs, as Mooncake keys. No locks.

    dprl/<pid>/meta              the PartitionMeta and an incarnation id <inc>; put-if-absent
    dprl/<pid>/i/<inc>           marker: this incarnation of the partition is live
    dprl/<pid>/r/<inc>/<n>       the n-th committed put: {"inc", "refs": [ChunkRef...]}; put-if-absent
    dprl/<pid>/c/<inc>/<id>      blocks of one put (store.py)

A put's record normally goes into the next slot in the same calls as its blocks (commit.py), after this
process has read the slots it had not seen (`catch_up`). If another writer took that slot, `commit`
appends the long way: reserve the slot after the last one known (put-if-absent, with the marker check);
on -705 read the slots missed, re-check conflicts, aim at the next. A slot reserved alone is held only
while its small record is filled and published (two calls), never across a lock; one whose writer died
before publishing is freed by the master when the next writer asks for it after
put_start_discard_timeout_sec, so a commit waits for it (slower, not an error, within RETRY_DEADLINE_S).

Refs are cached per process; a known partition is checked with one master RPC (`batch_is_exist` of the
marker and the next slots: no data moves). Every key of an incarnation has <inc> in its name, so a
partition dropped and created again never reads, blocks on or removes the old one's keys; create and drop
need no lock: meta is put-if-absent, and a drop removes the marker first (a commit racing it fails its
marker check) and meta last (so no create of the id can start before the old keys are gone).

Mooncake quirk handled here: a plain put of an existing key returns OK and keeps the old value, so every
contended key is written with a put session. Transient answers are retried (retry.py).
"""

from __future__ import annotations

import contextlib
import json
import re
import threading
import uuid
from dataclasses import dataclass, field
from typing import Callable, Iterator

import numpy as np

from dataplane_rl.errors import CorruptChunkError, StoreUnavailableError
from dataplane_rl.store.chunks import PID, ChunkRef, PartitionMeta, refs_to_json
from dataplane_rl.store.mooncake.buffers import Arenas
from dataplane_rl.store.mooncake.client import (
    ILLEGAL_CLIENT,
    INVALID_PARAMS,
    MAX_KEYS_PER_BATCH,
    OBJECT_ALREADY_EXISTS,
    OBJECT_NOT_FOUND,
    OK,
    REPLICA_IS_NOT_READY,
    TRANSFER_FAIL,
    list_keys,
)
from dataplane_rl.store.mooncake.retry import READ_TRANSIENT, RETRY_DEADLINE_S, Retries

PREFIX = "dprl/"
_SLOT = 64 << 10  # bytes per catalog key in one batched read; a bigger value is re-read at its size
# refs keys asked for beyond the last one known, per master RPC (doubling up to _MAX_PROBE while all are there)
_PROBE = 8
_MAX_PROBE = 64
# put_if_absent: nothing was published (our transfer failed transiently, or the master discarded our
# reservation), so the key is still free: put it again. Positive: no Mooncake answer is.
AGAIN = 1


def batches(n: int) -> Iterator[slice]:
    """Slices of at most MAX_KEYS_PER_BATCH keys (bigger batches can wedge Mooncake's TCP transport)."""
    for lo in range(0, n, MAX_KEYS_PER_BATCH):
        yield slice(lo, min(n, lo + MAX_KEYS_PER_BATCH))


def meta_key(pid: str) -> str:
    return f"{PREFIX}{pid}/meta"


def marker_key(pid: str, inc: str) -> str:
    return f"{PREFIX}{pid}/i/{inc}"


def refs_prefix(pid: str, inc: str) -> str:
    return f"{PREFIX}{pid}/r/{inc}/"


def refs_key(pid: str, inc: str, n: int) -> str:
    return f"{refs_prefix(pid, inc)}{n}"


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
    # threads of one process read and append slots of the same partition (a put's commit, a wait)
    lock: threading.Lock = field(default_factory=threading.Lock, repr=False, compare=False)

    @property
    def inc(self) -> str:
        return self.meta.token


class Catalog:
    """The catalog keys of one client. `error(code, what)` and `not_found(pid, why)` build the store's errors;
    `retried()` counts a transient answer that was retried."""

    def __init__(self, client, pin, arenas: Arenas, admin: str, check: Callable[[str], None],
                 error: Callable[[int, str], Exception], not_found: Callable[..., Exception],
                 retried: Callable[[], None]) -> None:
        self._client, self._pin, self._arenas, self._admin = client, pin, arenas, admin
        self._check, self._error, self._not_found, self._retried = check, error, not_found, retried
        self.client, self.pin, self.check, self.error, self.not_found = client, pin, check, error, not_found
        self.parts: dict[str, Part] = {}
        self.lock_timeout_s = RETRY_DEADLINE_S  # how long a commit waits for a slot another writer reserved

    def retries(self) -> Retries:
        return Retries(self._retried, self._check)

    # -- small values ----------------------------------------------------------------------------
    def get_small(self, keys: list[str]) -> list[bytes | None]:
        """Values of small keys in one batch_get_into; None for a missing (or not yet published) key."""
        buf = self._arenas.get("catalog", len(keys) * _SLOT)
        retries = self.retries()
        while True:
            codes = self._client.batch_get_into(keys, [buf.ptr + i * _SLOT for i in range(len(keys))],
                                                [_SLOT] * len(keys))
            slow = next((c for c in codes if c in READ_TRANSIENT), None)
            if slow is None or not retries.again(slow, f"reading catalog keys {keys[0]}.."):
                break
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
        retries = self.retries()
        while (code := self._client.batch_get_into([key], [buf.ptr], [size])[0]) in READ_TRANSIENT:
            if not retries.again(code, f"reading catalog key {key}"):
                break
        if code in (OBJECT_NOT_FOUND, REPLICA_IS_NOT_READY):
            return None
        if code < 0:
            raise self._error(code, f"reading catalog key {key}")
        return buf.array[:code].tobytes()

    def put_if_absent(self, key: str, data: bytes, must_exist: str | None = None) -> int:
        """OK; OBJECT_ALREADY_EXISTS if the key exists or is being written; AGAIN if we reserved it but
        published nothing (a holder did not answer, or the master discarded the reservation); OBJECT_NOT_FOUND
        if the key `must_exist` does not (checked in the same call, at no cost: reserving an existing key fails).

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
        lost = self.fill([(key, buf.ptr, len(data))], f"writing catalog key {key}")
        return AGAIN if lost else OK

    def put_new(self, key: str, data: bytes, what: str, must_exist: str | None = None) -> int:
        """put_if_absent, put again while it answers AGAIN (counted by `fill`), within the retry deadline."""
        retries = Retries.uncounted(self._check)
        while (code := self.put_if_absent(key, data, must_exist)) == AGAIN:
            if not retries.again(AGAIN, what):
                raise StoreUnavailableError(f"{what}: not published in {retries.tries + 1} tries over "
                                            f"{RETRY_DEADLINE_S:.0f} s (a holder did not answer, or the master "
                                            "discarded each reservation); check the Mooncake holders")
        return code

    def fill(self, items: list[tuple[str, int, int]], what: str, last: str | None = None) -> list[str]:
        """Fill and publish keys reserved by batch_put_session_start ((key, address, size) each); `last`
        is published only after all the others were (else revoked). Returns the keys whose transfer failed
        transiently or whose reservation the master discarded: revoked, not published, to be put again.
        Any other failure revokes every key not yet published and raises."""
        keys = [k for k, _, _ in items]
        ended: set[str] = set()
        again: list[str] = []
        try:
            for s in batches(len(items)):
                part = items[s]
                wrote = self._client.batch_put_from_multi_buffer_ranges(
                    keys[s], [[p] for _, p, _ in part], [[n] for _, _, n in part], [[0]] * len(part))
                for (k, _, n), w in zip(part, wrote):
                    if w in READ_TRANSIENT:  # the same transfer engine: a holder slow to answer
                        again.append(k)
                    elif w == INVALID_PARAMS:  # measured: a dead holder this client never reached (mooncake_notes.md)
                        raise StoreUnavailableError(
                            f"{self._error(w, f'{what} ({w} of {n} bytes)')}; a fill answers so when the key's holder "
                            "died before this client reached it (until the master drops its segment, after its "
                            "client_ttl): check the Mooncake holders")
                    elif w != n:
                        raise self._error(w if w < 0 else TRANSFER_FAIL, f"{what} ({w} of {n} bytes)")
            if again:
                with contextlib.suppress(Exception):
                    self._client.batch_put_session_revoke(again)
            todo = [k for k in keys if k not in set(again) and k != last]
            rounds = [todo[s] for s in batches(len(todo))] + ([[last]] if last is not None and last not in again else [])
            for part in rounds:
                if part == [last] and again:  # a block did not make it: the record must not be seen
                    self._client.batch_put_session_revoke([last])
                    again.append(last)
                    break
                codes = self._client.batch_put_session_end(part)
                for k, c in zip(part, codes):
                    if c == OK:
                        ended.add(k)
                    elif c in (OBJECT_NOT_FOUND, ILLEGAL_CLIENT):  # the master discarded our reservation (and
                        again.append(k)  # gave the key to another client: -601): nothing of ours was published
                    else:
                        raise self._error(c, what)
            if again:
                self._retried()
        except BaseException:
            with contextlib.suppress(Exception):
                left = [k for k in keys if k not in ended]
                for s in batches(len(left)):
                    self._client.batch_put_session_revoke(left[s])
            raise
        return again

    # -- partitions ------------------------------------------------------------------------------
    def fetch(self, pid: str) -> Part:
        """The partition's meta and committed refs. A known partition costs one master RPC (is its
        incarnation's marker there, and any refs key after the last known?) plus one read of new refs;
        an unknown one, a read of the meta first."""
        if not isinstance(pid, str) or not PID.fullmatch(pid):
            raise self._not_found(pid)
        self._check(f"partition {pid}")
        part = self.parts.get(pid)
        if part is not None and self._refresh(pid, part):
            return part
        self.parts.pop(pid, None)
        text = self.get_small([meta_key(pid)])[0]
        if text is None:
            raise self._not_found(pid)
        doc = json.loads(text)
        inc = doc.pop("incarnation")
        part = Part(PartitionMeta.from_json(json.dumps(doc), inc))
        if not self._refresh(pid, part):  # dropped since the meta was read
            raise self._not_found(pid)
        self.parts[pid] = part
        return part

    def known(self, pid: str, inc: str) -> Part:
        """What this process knows of the partition, read only if it knows nothing (a commit aims past it)."""
        part = self.parts.get(pid)
        return part if part is not None and part.inc == inc else self.fetch(pid)

    def _refresh(self, pid: str, part: Part) -> bool:
        """Read the refs keys committed since this process last looked; False if the partition is gone or
        was dropped and made again (its incarnation's marker is gone)."""
        return self._read_new(pid, part, marker=True)

    def _read_new(self, pid: str, part: Part, marker: bool) -> bool:
        """Ask the master which of the next slots are published (`batch_is_exist`: one RPC, no data moves,
        and a slot still being written answers 0) and read exactly those in one batched read; again, asking
        for twice as many, while every slot asked for was there. With `marker`, the incarnation's marker is
        asked in the same RPC: False if it is gone. A transfer costs its caller CPU for as long as the holder
        takes to answer (docs/mooncake_notes.md), so nothing is read that is not there."""
        probe = _PROBE
        prefix = refs_prefix(pid, part.inc)
        while True:
            n = part.puts
            keys = [prefix + str(k) for k in range(n, n + probe)]
            if marker:
                keys.insert(0, marker_key(pid, part.inc))
            there = self._client.batch_is_exist(keys)  # master only: no transfer
            bad = next((c for c in there if c < 0), None)
            if bad is not None:
                raise self._error(bad, f"partition {pid}: looking up catalog keys")
            if marker and there[0] != 1:
                return False
            slots, there = (keys[1:], there[1:]) if marker else (keys, there)
            new = next((i for i, c in enumerate(there) if c != 1), probe)
            if new == 0 or self._take_refs(part, n, self.get_small(slots[:new])) < probe:
                return True
            probe = min(2 * probe, _MAX_PROBE)  # every slot asked for was there: there may be many more

    def record(self, pid: str, part: Part, refs: list[ChunkRef]) -> tuple[str, bytes]:
        """The key of the slot after the last one known, and the record of `refs` to put there."""
        payload = json.dumps({"inc": part.inc, "refs": json.loads(refs_to_json(refs))}).encode()
        return refs_key(pid, part.inc, part.puts), payload

    def appended(self, part: Part, n: int, refs: list[ChunkRef]) -> None:
        """Our record went into slot n: add it to what this process knows."""
        with part.lock:
            if part.puts == n:
                part.refs = part.refs + list(refs)
                part.puts += 1

    def catch_up(self, pid: str, part: Part) -> None:
        """Read the slots other writers published from part.puts on (nothing when there are none)."""
        self._check(f"partition {pid}")
        self._read_new(pid, part, marker=False)

    @staticmethod
    def _take_refs(part: Part, first: int, values: list[bytes | None]) -> int:
        """Add the values of refs keys first, first+1, ... up to the first missing one, skipping those
        another thread added meanwhile; how many were there."""
        there = next((i for i, v in enumerate(values) if v is None), len(values))
        with part.lock:
            for k, v in enumerate(values[:there], start=first):
                if k != part.puts:
                    continue  # another thread of this process took it already
                try:
                    doc = json.loads(v)
                    part.refs = part.refs + [ChunkRef.from_json(d) for d in doc["refs"]]
                except (KeyError, ValueError, TypeError) as e:  # e.g. refs of the IPC-block format (before v4)
                    raise CorruptChunkError(f"partition {part.meta.pid}: commit {part.puts} is not in this "
                                            f"dataplane-rl's format ({e!r}); it was written by another version: "
                                            "drop the partition and regenerate the step") from None
                part.puts += 1
        return there

    def create(self, meta: PartitionMeta) -> bool:
        """Publish a new partition's meta; False if the id is taken. The marker goes first, so every
        published meta has its marker; meta's put-if-absent decides between two creates."""
        self._check(f"partition {meta.pid}")
        inc = uuid.uuid4().hex[:12]
        text = json.dumps({**json.loads(meta.to_json()), "incarnation": inc}).encode()
        marker = marker_key(meta.pid, inc)
        code = self.put_new(marker, b"1", f"partition {meta.pid}: writing catalog key {marker}")
        if code != OK:  # a fresh key
            raise self._error(code, f"partition {meta.pid}: writing catalog key {marker}")
        code = None
        try:  # AGAIN is not "taken": a create whose meta did not reach its holder must not say the id exists
            code = self.put_new(meta_key(meta.pid), text, f"partition {meta.pid}: writing catalog key {meta_key(meta.pid)}")
        finally:
            if code != OK:
                self._client.remove(marker, True)
        if code == OBJECT_ALREADY_EXISTS:
            return False
        self.parts[meta.pid] = Part(PartitionMeta(meta.pid, meta.schema_json, meta.num_rows, inc))
        return True

    def drop(self, pid: str) -> None:
        """Remove the marker (commits in flight now fail their check), every key of the incarnation, then
        the meta, unless a create of the id made a new one meanwhile (two drops racing a create)."""
        part = self.fetch(pid)  # PartitionNotFoundError if unknown
        inc = part.inc
        self._client.remove(marker_key(pid, inc), True)
        n = self._client.remove_by_regex(f"^{re.escape(PREFIX + pid)}/[rc]/{inc}/", True)
        if n < 0:
            raise self._error(n, f"dropping partition {pid}")
        text = self.get_small([meta_key(pid)])[0]
        if text is not None and json.loads(text).get("incarnation") == inc:
            code = self._client.remove(meta_key(pid), True)
            if code not in (OK, OBJECT_NOT_FOUND):
                raise self._error(code, f"dropping partition {pid}")
        self.parts.pop(pid, None)

    def commit(self, meta: PartitionMeta, refs: list[ChunkRef], conflict: Callable[[Part], Exception | None],
               checked: int = -1) -> None:
        """Append the put's record at the slot after the last one this process knows, reading nothing
        first; on -705 (another writer's slot) read the slots not seen yet, re-check and aim at the next.
        The incarnation's marker is checked in the same call as the reservation, which catches a drop.
        `checked`: the caller checked conflicts against the first `checked` slots (not again while no
        more are known)."""
        pid, inc = meta.pid, meta.token
        payload = json.dumps({"inc": inc, "refs": json.loads(refs_to_json(refs))}).encode()
        part = self.known(pid, inc)
        retries = None
        while True:
            if part.inc != inc:
                raise self._not_found(pid, "was dropped while this put was writing (nothing was written)")
            n = part.puts
            if n != checked:  # slots this put was not checked against yet
                err = conflict(part)
                if err:
                    raise err
                checked = n
            key = refs_key(pid, inc, n)
            code = self.put_new(key, payload, f"partition {pid}: writing catalog key {key}", marker_key(pid, inc))
            if code == OK:
                self.appended(part, n, refs)
                return
            if code == OBJECT_NOT_FOUND:
                raise self._not_found(pid, "was dropped while this put was writing (nothing was written)")
            self.catch_up(pid, part)  # another writer's commit: read it (and any after it)
            if part.puts == n:  # reserved, not yet published: its writer is filling it, or died (the master frees it)
                # waiting, not a retry of an error: not counted; polled often, as its record is filled in a call
                retries = retries or Retries.uncounted(self._check, self.lock_timeout_s, 0.01)
                if not retries.again(OBJECT_ALREADY_EXISTS, f"partition {pid}"):
                    raise StoreUnavailableError(f"partition {pid}: refs key {key} stayed reserved for "
                                                f"{self.lock_timeout_s:.0f}s (a writer died inside its commit, and "
                                                "the master has not freed it?); retry the put later")

    def list(self) -> list[str]:
        self._check("listing partitions")
        keys = list_keys(self._admin, PREFIX)
        return [k[len(PREFIX):-len("/meta")] for k in keys if k.endswith("/meta") and k.count("/") == 2]
