"""What an shm store keeps per process: maps of chunk files, and leases on the partitions it maps.

Each process keeps its maps of chunk files (`Maps`), because filling page tables for a new map costs about
as much as copying the bytes on this kind of machine, and pooled files come back step after step. A
`Lease` (a shared flock on DIR/<pid>/readers) lives as long as any buffer handed out from the partition,
so a drop pools the partition's files only when no process still maps them.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import stat
import threading
import time
from collections import OrderedDict
from typing import Iterator

import pyarrow as pa

from dataplane_rl.store.shm_files import check_trusted, open_file


class Maps:
    """Memory maps of chunk files, kept open across puts and gets and keyed by inode.

    Cached bytes are never trusted: every read is checksummed. A map of a deleted file pins its pages, so
    maps of deleted files are closed by a sweep at most every 0.5 s of store use, and the cache is bounded
    (least recently used first)."""

    def __init__(self, max_bytes: int, max_files: int = 256) -> None:
        self._files: OrderedDict[tuple[int, int], pa.MemoryMappedFile] = OrderedDict()
        self._max_bytes, self._max_files = max_bytes, max_files
        self._bytes = 0
        self._lock = threading.Lock()
        self._swept = time.monotonic()

    @contextlib.contextmanager
    def file(self, path: str, size: int, writable: bool, st: os.stat_result | None = None) -> Iterator[pa.MemoryMappedFile]:
        """The mapped file at `path` (`st`: its stat, if just taken), mapping at least `size` bytes; raises
        FileNotFoundError."""
        st = st or os.lstat(path)
        if not stat.S_ISREG(st.st_mode) or st.st_uid != os.getuid():
            check_trusted(path, folder=False)  # a symlink or another user's file where a chunk file belongs
        key = (st.st_dev, st.st_ino)
        with self._lock:
            f = self._files.pop(key, None)
            if f is not None:
                self._bytes -= f.size()
        if f is not None and (f.size() < size or (writable and f.mode != "rb+")):
            f.close()
            f = None
        if f is None:
            f = pa.memory_map(path, "r+" if writable else "r")
        try:
            yield f
        finally:
            self._keep(key, f)

    def _keep(self, key: tuple[int, int], f: pa.MemoryMappedFile) -> None:
        if self._max_bytes <= 0:
            f.close()  # buffers already handed out keep their mapping
            return
        with self._lock:
            if key in self._files:  # another thread mapped it meanwhile
                self._evict(key)
            self._files[key] = f
            self._bytes += f.size()
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
        self._bytes -= f.size()
        f.close()

    def close(self) -> None:
        with self._lock:
            while self._files:
                self._evict(next(iter(self._files)))


class Lease:
    """A shared flock on DIR/<pid>/readers, held while any buffer of the partition lives here.

    Every buffer a get returns references its lease, so the lock goes when the last array does."""

    def __init__(self, path: str) -> None:
        self.fd = -1
        fd = open_file(path, os.O_RDONLY)
        try:
            fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        except OSError:
            os.close(fd)
            raise
        self.fd, self.ino = fd, os.fstat(fd).st_ino

    def __del__(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
