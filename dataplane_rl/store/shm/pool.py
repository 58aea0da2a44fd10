"""The pool of an shm store: segment files of dropped partitions, kept in DIR/.pool for later puts.

Why: a fresh tmpfs page costs an allocation (measured ~1.1 GB/s writing new /dev/shm files vs ~8.6 GB/s
into pages already faulted in), and RL steps write the same shapes every step. A dropped partition's
segments are pooled only when no process still maps it (its `readers` lock), so reuse never changes bytes
under a live zero-copy array, and only those no put is writing (the segment's own lock). A segment
DIR/<pid>/chunks/put-<hex> is pooled as `<bytes>-<hex>` and claimed back as put-<hex> (its hex is its name
for life), so a writer can ask for the segments it wrote before by name; a claim is a rename, which is
atomic: of two writers wanting one file, one gets it.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import mmap
import os
import shutil
import uuid

from dataplane_rl.store.shm.files import open_file


def _idle(path: str) -> bool:
    """No put is writing into this segment (shm.py holds a shared flock on it while it writes), and none
    can start: a put checks, under that lock, that its partition is still there."""
    fd = open_file(path, os.O_RDONLY)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        return True
    except BlockingIOError:
        return False
    finally:
        os.close(fd)


class Pool:
    def __init__(self, folder: str, limit: int) -> None:
        self._dir, self._limit = folder, limit

    def bytes(self) -> int:
        return sum(cap for _, cap in self.files())

    def claim(self, folder: str, size: int, most: int | None = None,
              mine: list[tuple[str, int]] = ()) -> tuple[str, int]:
        """Put a segment of at least `size` bytes in `folder` as put-<hex>; return (hex, its bytes). A pooled
        one (see `take`) if any fits, else a new one. A pooled file is never truncated: its pages are the
        point of pooling it."""
        got = self.take(folder, size, most, mine)
        if got is None:
            got = uuid.uuid4().hex, size
            self._reserve(os.path.join(folder, f"put-{got[0]}"), size)
        return got

    def take(self, folder: str, size: int, most: int | None = None,
             mine: list[tuple[str, int]] = ()) -> tuple[str, int] | None:
        """Move a pooled segment of `size` to `most` bytes into `folder` as put-<hex> (a pooled file keeps
        its hex; its name says its bytes) and return (hex, bytes), or None if none is there. `mine`: (hex,
        bytes) of segments this process wrote before, smallest first: in a steady run they come back, their
        pages already mapped here, so each that fits is asked for by name (no listing); then, from one
        listing, another of this process's if it is there, else the smallest that fits. (Three tries by name
        used to end in taking another writer's segment when names it had lost were tried first: with 4
        writers, a writer faulted ~12,000 pages of segments new to it in a round.)"""
        top = most if most is not None else float("inf")
        for hex_, cap in mine:
            if size <= cap <= top:
                with contextlib.suppress(FileNotFoundError):  # not pooled (yet), or another writer's now
                    os.rename(os.path.join(self._dir, f"{cap}-{hex_}"), os.path.join(folder, f"put-{hex_}"))
                    return hex_, cap
        for cand, cap in self._candidates(size, most, {h for h, _ in mine}):
            hex_ = os.path.basename(cand).partition("-")[2]
            try:
                os.rename(cand, os.path.join(folder, f"put-{hex_}"))  # atomic: of two writers wanting one, one gets it
            except FileNotFoundError:
                continue
            return hex_, cap
        return None

    def clear(self) -> None:
        """Delete every pooled file (to make room for a segment of another size)."""
        for cand, _ in self.files():
            with contextlib.suppress(OSError):
                os.unlink(cand)

    def add_new(self, size: int) -> bool:
        """Pool a new segment of `size` bytes (see `_reserve`). False if the filesystem has no room for it."""
        path = os.path.join(self._dir, f"{size}-{uuid.uuid4().hex}")
        tmp = os.path.join(self._dir, f".new-{uuid.uuid4().hex}")  # not a pool name until it is whole
        try:
            self._reserve(tmp, size)
            os.rename(tmp, path)
        except OSError as e:
            with contextlib.suppress(OSError):
                os.unlink(tmp)
            if e.errno == errno.ENOSPC:
                return False
            raise
        return True

    def _reserve(self, path: str, size: int) -> None:
        """Make `path` a segment of `size` bytes with every page allocated and touched now: a mapped page the
        filesystem cannot back later would SIGBUS the writer (posix_fallocate says ENOSPC instead), and a
        page's first write costs ~10x a later one here (tmpfs clears it, and the VM backs it), so a segment
        that only its first step used part of would make later steps pay that per put (a writable
        MAP_POPULATE map touches every page once). When space is short, pooled files go first."""
        fd = open_file(path, os.O_RDWR | os.O_CREAT | os.O_EXCL)
        try:
            try:
                os.posix_fallocate(fd, 0, size)
            except OSError as e:
                if e.errno != errno.ENOSPC or not self.files():
                    raise
                for cand, _ in self.files():  # the pool is only a cache: space for a put comes first
                    with contextlib.suppress(OSError):
                        os.unlink(cand)
                os.posix_fallocate(fd, 0, size)
            mmap.mmap(fd, size, flags=mmap.MAP_SHARED | mmap.MAP_POPULATE).close()
        except BaseException:
            os.close(fd)
            with contextlib.suppress(OSError):
                os.unlink(path)
            raise
        os.close(fd)

    def _candidates(self, size: int, most: int | None = None, own: set[str] = frozenset()) -> list[tuple[str, int]]:
        """Pooled files to try, best first: this process's own (`own`: their hex), then the smallest that
        fits. Listed each time: another process's drop may have pooled one since."""
        pool = self.files()
        top = most if most is not None else float("inf")
        fits = (c for c in pool if size <= c[1] <= top)
        return sorted(fits, key=lambda c: (os.path.basename(c[0]).partition("-")[2] not in own, c[1]))[:8]

    def files(self) -> list[tuple[str, int]]:
        """(path, capacity) of each pooled file."""
        out = []
        with contextlib.suppress(FileNotFoundError):
            for n in os.listdir(self._dir):
                cap, _, _ = n.partition("-")
                if cap.isdigit():
                    out.append((os.path.join(self._dir, n), int(cap)))
        return out

    def take_back(self, trash: str) -> None:
        """Pool the chunk files of a dropped partition if nobody maps them any more; delete the rest."""
        fd = -1
        try:
            fd = open_file(os.path.join(trash, "readers"), os.O_RDONLY)
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            room = self._limit - self.bytes()
            for entry in os.scandir(os.path.join(trash, "chunks")):
                size = entry.stat().st_size
                if not entry.name.startswith("put-") or not 0 < size <= room or not _idle(entry.path):
                    continue
                os.rename(entry.path, os.path.join(self._dir, f"{size}-{entry.name[4:]}"))  # keeps its hex
                room -= size
        except OSError:
            pass  # still mapped somewhere (BlockingIOError): deleted below, freed when the last mapping goes
        finally:
            if fd >= 0:
                os.close(fd)
            shutil.rmtree(trash, ignore_errors=True)
