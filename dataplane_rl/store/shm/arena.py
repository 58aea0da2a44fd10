"""The shm arena: pre-touched segment files, handed out to puts by offset, reused after a drop, bounded.

Why: writing into fresh tmpfs pages ran at ~1.1-1.5 GB/s on the 2-core machine, into pages already
allocated and mapped at ~11 GB/s (`bench store`'s fresh-page and memcpy figures, docs/benchmarks.md); a file
per put paid for the fresh pages, a claim, a map lookup and a rename every time. So a writer keeps one *open segment* per
partition (a file in DIR/<pid>/chunks/, mapped once) and places each put at the next free 64-byte-aligned
offset: one lock and two integers per put. Segments come from DIR/.pool (filled at store creation with
`prefault_bytes` of allocated pages, and by drops, which pool a partition's segments when no process
maps it any more), so a steady run writes into the same pages, already mapped, step after step.

Write-once and crash safety are the catalog's, unchanged: a range is handed out once per segment life and
is visible only through a committed refs file, so bytes of a put that died never show. The arena's bytes
(segments in use plus pooled) never exceed `limit_bytes`: past it a put is a StoreFullError naming
`data_plane.shm.arena_mb`, never an eviction.
"""

from __future__ import annotations

import contextlib
import os
import threading
from collections import OrderedDict
from dataclasses import dataclass

from dataplane_rl.errors import StoreFullError
from dataplane_rl.store.chunks import align

MiB = 1 << 20
MIN_SEGMENT = 64 << 10  # smallest segment: a kept run's many small partitions must not each hold a large one
PREFAULT_SEGMENT = 8 * MiB  # pre-touched segments come in this size; a put may take one up to this much larger
DEFAULT_SEGMENT = 64 * MiB  # a partition's segments double up to this size
DEFAULT_ARENA = 16 << 30  # arena_mb default: far above a step's columns, well below a node's RAM
DEFAULT_PREFAULT = 64 * MiB
# segments this process wrote lately, preferred when it claims one (pool.take): a writer's partition grows
# through ~7-10 doubling segments a step (64 KiB .. 64 MiB), more than the 8 it used to remember
_MINE = 64


def segment_size(need: int, previous: int, largest: int) -> int:
    """A new segment for a put of `need` bytes: twice the partition's previous one (so a partition of many
    small puts claims few segments), at least MIN_SEGMENT, at most `largest`; a power of two, so segments
    of a steady run come back to the pool in few sizes. A put larger than `largest` gets a segment its size."""
    if need > largest:  # a put of its own: sized to it (whole MiB), a power of two would waste up to half
        return -(-need // MiB) * MiB
    want = max(need, MIN_SEGMENT, min(2 * previous, largest))
    return 1 << (want - 1).bit_length()


@dataclass
class Segment:
    """A writer's open segment of one partition incarnation: `used` bytes handed out of `size`."""

    token: str
    name: str  # put-<hex>: the file's name in the partition's chunks/ folder, and its keys' object part
    size: int
    used: int


class Arena:
    """The segments this process writes into, and the arena's bound (shared by every process of a store:
    counted from the folder, so only when a segment is made, never per put)."""

    def __init__(self, store_dir: str, pool, limit_bytes: int, segment_bytes: int = DEFAULT_SEGMENT) -> None:
        self._dir, self._pool = store_dir, pool
        self.limit_bytes, self.segment_bytes = limit_bytes, segment_bytes
        self._open: dict[str, Segment] = {}  # pid -> the segment the next put of this process goes to
        self._mine: OrderedDict[str, int] = OrderedDict()  # hex -> bytes: segments this process wrote lately
        self._lock = threading.Lock()

    def place(self, pid: str, token: str, folder: str, need: int) -> tuple[str, int, bool]:
        """(segment name, offset, made now) for a put of `need` bytes: the next free range of the
        partition's open segment, or the start of a new segment claimed into `folder`."""
        need = align(max(need, 1))
        with self._lock:
            seg = self._open.get(pid)
            if seg is not None and seg.token == token and seg.used + need <= seg.size:
                off, seg.used = seg.used, seg.used + need
                return seg.name, off, False
            previous = seg.size if seg is not None and seg.token == token else 0
        size = segment_size(need, previous, self.segment_bytes)
        hex_, cap = self.claim(folder, size)
        with self._lock:
            # the size asked for, even from a larger pooled file: a steady run then asks for the same sizes
            # step after step and gets the same segments back in the same roles, ranges it made present
            # in its map already (making a range present costs ~0.8 µs a page here, even for touched pages)
            self._open[pid] = Segment(token, f"put-{hex_}", size, need)
            self._mine.pop(hex_, None)
            self._mine[hex_] = cap
            while len(self._mine) > _MINE:
                self._mine.popitem(last=False)
        return f"put-{hex_}", 0, True

    def claim(self, folder: str, size: int) -> tuple[str, int]:
        """(hex, bytes) of a segment of at least `size` bytes claimed into `folder`: a pooled one if any
        fits (one this process wrote before first), else a new one if the arena's bound allows it (pooled
        files of other sizes go first: the pool is only a cache)."""
        most = max(4 * size, PREFAULT_SEGMENT)  # a pooled segment far larger than asked would strand its pages
        with self._lock:
            mine = sorted(reversed(self._mine.items()), key=lambda m: m[1])  # the smallest first, then most recent
        got = self._pool.take(folder, size, most, mine)  # pooled bytes are counted already
        if got is not None:
            return got
        used = self.bytes_used()  # a new file: counted against the bound first
        if used + size > self.limit_bytes:
            self._pool.clear()
            used = self.bytes_used()
        if used + size > self.limit_bytes:
            raise StoreFullError(
                f"shm store {self._dir}: the arena is full ({used} of {self.limit_bytes} bytes in partitions and "
                f"pooled segments, {size} more asked); nothing of this put was kept. Drop partitions, or raise "
                "data_plane.shm.arena_mb (the shm:// URL's ?arena_mb=N)")
        return self._pool.claim(folder, size, most)  # another process's drop may have pooled one since

    def done(self, pid: str, name: str, off: int, need: int, ok: bool) -> bool:
        """A put placed at `off` of segment `name` committed (`ok`) or failed. A failed put gives its range
        back when it was the last one handed out; returns True when the segment is then empty (made for
        this put): the caller removes its file."""
        need = align(max(need, 1))
        with self._lock:
            seg = self._open.get(pid)
            if seg is None or seg.name != name:
                return False
            if ok or seg.used != off + need:  # committed, or another put was placed after it
                return False
            seg.used = off
            if off == 0:
                del self._open[pid]
                return True
            return False

    def forget(self, pid: str) -> None:
        with self._lock:
            self._open.pop(pid, None)

    def clear(self) -> None:
        with self._lock:
            self._open.clear()

    def bytes_used(self) -> int:
        """Bytes of every segment of the store: in partitions (any process's) and pooled."""
        total = self._pool.bytes()
        with contextlib.suppress(FileNotFoundError):
            for part in os.scandir(self._dir):
                if part.name.startswith(".") or not part.is_dir(follow_symlinks=False):
                    continue
                with contextlib.suppress(FileNotFoundError, NotADirectoryError):
                    for f in os.scandir(os.path.join(part.path, "chunks")):
                        with contextlib.suppress(FileNotFoundError):
                            total += f.stat(follow_symlinks=False).st_size
        return total

    def prefault(self, nbytes: int) -> None:
        """Fill the pool with `nbytes` of allocated pages, in PREFAULT_SEGMENT pieces, at store creation:
        the first round of a run then writes into allocated pages, not fresh ones. Best effort: a filesystem
        too small for it keeps what fitted."""
        left = min(nbytes, self.limit_bytes)
        while left >= MIN_SEGMENT:
            size = min(PREFAULT_SEGMENT, 1 << (left.bit_length() - 1))
            if not self._pool.add_new(size):
                return
            left -= size

