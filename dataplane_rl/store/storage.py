"""What a backend supplies to ColumnStore: storage for a partition's meta and its blocks (docs/architecture.md §5).

ColumnStore (base.py) implements every public call once — validation, row identity, write-once cells,
all-or-nothing puts, missing-cell errors, checksums, readiness — over one `Storage` object, the way
pyarrow's `PyFileSystem` works over a `FileSystemHandler`. A backend is a subclass of `Storage`: it
stores bytes and records which blocks are committed, and keeps no state between calls that the store
has to know about. Each method has one return type:

    create(meta) -> None                         record a new partition
    snapshot(pid) -> Snapshot                    the partition's meta and committed refs, in one catalog read
    known_snapshot(pid) -> Snapshot | None       what this process already holds, without a read
    store(meta, blocks) -> Staged                the bytes of a put's blocks, not yet visible
    commit(meta, staged, seen, conflict) -> None make them visible at once, if no cell is written already
    discard(meta, refs) -> None                  remove the stored bytes of a put that did not commit
    read(pid, refs) -> [pa.Buffer]               the bytes of committed blocks
    drop(pid), list(), forget(pid), close()      the rest of a partition's life
    share_counters, other_counters, gauges       what `stats()` adds up across processes

Bytes are stored first and refs committed last, so a failed or concurrent put never leaves a half-written
partition. The write-once check needs the store's row index, so the store hands `commit` a `conflict`
function instead of the storage reaching into the store.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any, Callable, NamedTuple

import pyarrow as pa

from dataplane_rl.errors import DataPlaneError, PartitionNotFoundError
from dataplane_rl.store.chunks import Block, ChunkRef, PartitionMeta, Snapshot

# conflict(snapshot, refs): the error naming the first cell of `refs` already committed in `snapshot`, or None
Conflict = Callable[[Snapshot, "list[ChunkRef]"], "DataPlaneError | None"]


class Staged(NamedTuple):
    """A put's stored blocks, not yet visible: one ref per block, in order, and what the storage needs to
    finish the put at its commit (Mooncake: the objects it stores in the same calls as the commit record;
    None where the bytes are already in place)."""

    refs: list[ChunkRef]
    pending: Any = None


class Storage(ABC):
    """Where a ColumnStore keeps a partition's meta, its committed refs and its blocks' bytes."""

    # Whether `commit` keeps cells write-once without the put checking them first against what other
    # writers committed (shm's claims): a put from `known_snapshot` then skips that check.
    checks_alone: bool = False

    @property
    @abstractmethod
    def url(self) -> str:
        """A URL another process can pass to open_store to reach the same data."""

    @abstractmethod
    def create(self, meta: PartitionMeta) -> None:
        """Record a new partition; PartitionExistsError if the id is taken. Its token is the storage's own."""

    @abstractmethod
    def snapshot(self, pid: str) -> Snapshot:
        """Meta (with the incarnation token) and committed refs, read now; PartitionNotFoundError if unknown."""

    def known_snapshot(self, pid: str) -> Snapshot | None:
        """What this process already holds of `pid`, without a catalog read, for a put to start from; None if it
        holds nothing (the default: every put reads `snapshot`). A stale answer must end in
        PartitionNotFoundError before anything is committed (the store then reads `snapshot` and tries once more),
        and `commit` must check against every commit made since."""
        return None

    @abstractmethod
    def store(self, meta: PartitionMeta, blocks: list[Block]) -> Staged:
        """Store each block with `chunks.write_block` (or `encode_block`); one ref per block, in order. Nothing
        is visible to readers yet. If it raises, it removes whatever it stored."""

    @abstractmethod
    def commit(self, meta: PartitionMeta, staged: Staged, seen: list[ChunkRef], conflict: Conflict) -> None:
        """Make `staged` visible at once, after checking under the catalog's lock that none of its cells is
        committed (raise what `conflict(snapshot, refs)` returns). The put checked against the committed refs
        `seen` already, so while they are still that list the check may be skipped. PartitionNotFoundError if
        the incarnation `meta.token` is gone."""

    @abstractmethod
    def discard(self, meta: PartitionMeta, refs: list[ChunkRef]) -> None:
        """Delete the stored bytes of refs that are not committed (a failed commit). Must not raise."""

    @abstractmethod
    def read(self, pid: str, refs: list[ChunkRef]) -> list[pa.Buffer]:
        """The bytes of each ref, in order (an empty buffer for bytes that are gone)."""

    @abstractmethod
    def drop(self, pid: str) -> None:
        """Forget the partition and free its blocks; PartitionNotFoundError if unknown."""

    @abstractmethod
    def list(self) -> list[str]:
        """Ids of live partitions."""

    def forget(self, pid: str) -> None:
        """Drop what this process caches about `pid`; it is read again when needed."""

    def close(self) -> None:
        """Release what this process holds (files, clients, processes it started)."""

    def share_counters(self, metrics: dict[str, float], final: bool) -> None:
        """Write this process's counters where other processes of the store can add them up (shm)."""

    def other_counters(self) -> dict[str, float]:
        """The counters other processes of the store wrote, added up, for `stats()`."""
        return {}

    def gauges(self) -> dict[str, float]:
        """The storage's own gauges for `stats()` (capacity, space), in Prometheus names."""
        return {}

    def not_found(self, pid: Any, why: str = "is unknown or dropped") -> DataPlaneError:
        """The error for a partition that is not there, naming the live ones (if they can be listed)."""
        try:
            live = sorted(self.list()) or "none"
        except (OSError, DataPlaneError):
            live = "unknown"
        return PartitionNotFoundError(f"partition {pid} {why} in {self.url}; live partitions: {live}")

    def unwritten(self, pid: str, err: DataPlaneError) -> DataPlaneError:
        """The error for cells of `pid` that look unwritten (`err`: a get's or a wait's). A storage that can lose
        commits with a process (Mooncake) names the loss instead."""
        return err
