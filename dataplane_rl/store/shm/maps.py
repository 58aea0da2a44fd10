"""What an shm store keeps per process: maps of chunk files, and leases on the partitions it maps.

Each process keeps its maps of chunk files (`Maps`), because filling page tables for a new map costs about
as much as copying the bytes on this kind of machine, and pooled files come back step after step. A
`Lease` (a shared flock on DIR/<pid>/readers) lives as long as any buffer handed out from the partition,
so a drop pools the partition's files only when no process still maps them.
"""

from __future__ import annotations

import contextlib
import fcntl
import mmap
import os
import stat
import threading
import time
from collections import OrderedDict
from typing import Iterator

import numpy as np
import pyarrow as pa

from dataplane_rl.store.shm.files import check_trusted, open_file

_MADV_POPULATE_WRITE = getattr(mmap, "MADV_POPULATE_WRITE", 23)  # Linux 5.14; Python's mmap names it from 3.12


_UID = os.getuid()  # a process's user does not change; asked once, not per put


class ReadMap:
    """A chunk file mapped read-only (pyarrow's memory map; buffers handed out keep the mapping alive)."""

    writable = False
    key = (0, 0)  # (device, inode): its place in Maps

    def __init__(self, path: str) -> None:
        self._f = pa.memory_map(path, "r")
        self.size = self._f.size()
        self._buf = self._f.read_buffer(self.size)  # one buffer of the whole file; reads are slices of it

    def buffer(self, off: int, n: int) -> pa.Buffer:
        return self._buf.slice(off, n)

    def fileno(self) -> int:
        return self._f.fileno()

    def close(self) -> None:
        self._buf = None
        self._f.close()


class WriteMap:
    """A segment mapped for writing. Pages are made present per put range, once per process
    (`prepare`: one madvise(MADV_POPULATE_WRITE) instead of a fault per 4 KiB page), not for the whole
    segment at map time: MAP_POPULATE of a 64 MiB segment cost more than the 6 MB put that needed it.
    Python's mmap, because pyarrow's memory_map cannot madvise; it keeps its own copy of the
    descriptor, so a map costs two."""

    writable = True
    key = (0, 0)  # (device, inode): its place in Maps

    def __init__(self, path: str) -> None:
        fd = open_file(path, os.O_RDWR)
        try:
            self.size = os.fstat(fd).st_size
            self._mm = mmap.mmap(fd, self.size, flags=mmap.MAP_SHARED)
        except BaseException:
            os.close(fd)
            raise
        self._fd = fd
        self.array = np.frombuffer(self._mm, dtype=np.uint8)  # writable: what puts copy into
        self._buf = pa.py_buffer(self._mm)
        self._ready = 0  # bytes from the start made present here (ranges of a segment are handed out upwards)

    def prepare(self, off: int, n: int) -> None:
        """Make the pages of bytes off..off+n present and writable in this process, if not done already."""
        end = off + n
        if end <= self._ready:
            return
        start = max(off, self._ready) & ~(mmap.PAGESIZE - 1)
        with contextlib.suppress(OSError, ValueError):  # a kernel before 5.14: the writes fault pages in instead
            self._mm.madvise(_MADV_POPULATE_WRITE, start, min(self.size, end) - start)
        self._ready = end

    def buffer(self, off: int, n: int) -> pa.Buffer:
        return self._buf.slice(off, n)

    def fileno(self) -> int:
        return self._fd

    def close(self) -> None:
        # the map itself goes when the last buffer made from it does (mmap.close() would refuse while
        # buffers handed out still point into it)
        self._buf = self.array = self._mm = None
        os.close(self._fd)


class Maps:
    """Memory maps of chunk files, kept open across puts and gets and keyed by inode.

    Cached bytes are never trusted: every read is checksummed. A map of a deleted file pins its pages, so
    maps of deleted files are closed by a sweep at most every 0.5 s of store use, and the cache is bounded
    (least recently used first)."""

    def __init__(self, max_bytes: int, max_files: int = 256) -> None:
        self._files: OrderedDict[tuple[int, int], ReadMap | WriteMap] = OrderedDict()
        self._max_bytes, self._max_files = max_bytes, max_files
        self._bytes = 0
        self._lock = threading.Lock()
        self._swept = time.monotonic()

    @contextlib.contextmanager
    def file(self, path: str, size: int, writable: bool, st: os.stat_result | None = None) -> Iterator[ReadMap | WriteMap]:
        """The mapped file at `path` (`st`: its stat, if just taken), mapping at least `size` bytes; raises
        FileNotFoundError."""
        f = self.take(path, size, writable, st)
        try:
            yield f
        finally:
            self.keep(f)

    def take(self, path: str, size: int, writable: bool, st: os.stat_result | None = None) -> ReadMap | WriteMap:
        """`file` without the context manager (a put's path: a generator costs a few µs): lent to the caller
        until it gives it back with `keep`."""
        st = st or os.lstat(path)
        if not stat.S_ISREG(st.st_mode) or st.st_uid != _UID:
            check_trusted(path, folder=False)  # a symlink or another user's file where a chunk file belongs
        key = (st.st_dev, st.st_ino)
        with self._lock:
            f = self._files.pop(key, None)
            if f is not None:
                self._bytes -= f.size
        if f is not None and (f.size < size or (writable and not f.writable)):
            f.close()
            f = None
        if f is None:
            f = WriteMap(path) if writable else ReadMap(path)
            f.key = key
        return f

    def keep(self, f: ReadMap | WriteMap) -> None:
        """Give back what `take` lent."""
        self._keep(f.key, f)

    def _keep(self, key: tuple[int, int], f: ReadMap | WriteMap) -> None:
        if self._max_bytes <= 0:
            f.close()  # buffers already handed out keep their mapping
            return
        with self._lock:
            if key in self._files:  # another thread mapped it meanwhile
                self._evict(key)
            self._files[key] = f
            self._bytes += f.size
            now = time.monotonic()
            if now - self._swept > 0.5:
                self._swept = now
                for k, g in list(self._files.items()):
                    if os.fstat(g.fileno()).st_nlink == 0:
                        self._evict(k)
            while self._files and (self._bytes > self._max_bytes or len(self._files) > self._max_files):
                self._evict(next(iter(self._files)))

    def _evict(self, key: tuple[int, int]) -> None:
        f = self._files.pop(key)
        self._bytes -= f.size
        f.close()

    def close(self) -> None:
        with self._lock:
            while self._files:
                self._evict(next(iter(self._files)))


class Lease:
    """A shared flock on DIR/<pid>/readers (`fd`, open as long as `owner` is), held while any buffer of the
    partition lives here.

    Every buffer a get returns references its lease, so the lock goes when the last array does."""

    def __init__(self, owner, fd: int) -> None:
        self.owner, self.fd = owner, -1
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        self.fd = fd

    def __del__(self) -> None:
        if self.fd >= 0 and self.owner.readers_fd == self.fd:  # not closed with its owner meanwhile
            with contextlib.suppress(OSError):
                fcntl.flock(self.fd, fcntl.LOCK_UN)
