"""Registered memory for Mooncake transfers: zero-copy puts and gets need buffers the client registered.

`Arenas` keeps one buffer per thread and purpose (the write arena, catalog values), grown, never shrunk.
`ReadPool` lends landing buffers to gets; the Arrow arrays a get returns keep their lease alive, and the
buffer returns to the pool when the last of them goes (fresh pages cost a page fault each).
"""

from __future__ import annotations

import contextlib
import threading
import weakref

import numpy as np

from dataplane_rl.errors import StoreUnavailableError
from dataplane_rl.store.mooncake.client import error_name


class Buffer:
    """A numpy byte buffer registered with the client."""

    def __init__(self, client, nbytes: int) -> None:
        self.array = np.empty(nbytes, dtype=np.uint8)
        self.ptr = self.array.ctypes.data
        self.client = client
        rc = client.register_buffer(self.ptr, nbytes)
        if rc != 0:
            raise StoreUnavailableError(f"Mooncake register_buffer of {nbytes} bytes failed: {error_name(rc)}; "
                                        "lower data_plane.mooncake.local_buffer_size_mb")

    @property
    def nbytes(self) -> int:
        return self.array.nbytes

    def release(self) -> None:
        with contextlib.suppress(Exception):
            self.client.unregister_buffer(self.ptr)


class Arenas:
    """Per-thread registered buffers by name, so threads sharing a store never share a buffer."""

    def __init__(self, client) -> None:
        self._client = client
        self._tl = threading.local()
        self._all: list[Buffer] = []
        self._lock = threading.Lock()

    def get(self, name: str, nbytes: int) -> Buffer:
        """This thread's buffer `name`, at least `nbytes` long (grown to at least double, never shrunk)."""
        buf = getattr(self._tl, name, None)
        if buf is None or buf.nbytes < nbytes:
            new = Buffer(self._client, nbytes if buf is None else max(nbytes, 2 * buf.nbytes))
            with self._lock:
                if buf is not None:
                    self._all.remove(buf)
                    buf.release()
                self._all.append(new)
            setattr(self._tl, name, new)
            buf = new
        return buf

    def close(self) -> None:
        with self._lock:
            for b in self._all:
                b.release()
            self._all.clear()


class ReadLease:
    """One get's landing buffer; the Arrow buffers handed out keep it alive."""

    def __init__(self, buf: Buffer) -> None:
        self.buf = buf


class ReadPool:
    """Landing buffers for gets, reused once no returned array uses them, keeping at most `keep_bytes` idle."""

    def __init__(self, client, keep_bytes: int) -> None:
        self._client, self._keep = client, keep_bytes
        self._free: list[Buffer] = []
        self._lock = threading.Lock()
        self._closed = False

    def take(self, nbytes: int) -> ReadLease:
        with self._lock:
            fits = [b for b in self._free if nbytes <= b.nbytes <= 4 * nbytes + (1 << 20)]
            buf = min(fits, key=lambda b: b.nbytes) if fits else None
            if buf is not None:
                self._free.remove(buf)
        if buf is None:
            buf = Buffer(self._client, max(1 << 20, 1 << (max(nbytes, 1) - 1).bit_length()))
        lease = ReadLease(buf)
        weakref.finalize(lease, self._give_back, buf)
        return lease

    def _give_back(self, buf: Buffer) -> None:
        with self._lock:
            if not self._closed:
                self._free.append(buf)
                while sum(b.nbytes for b in self._free) > self._keep:
                    self._free.pop(0).release()

    def close(self) -> None:
        with self._lock:
            self._closed = True
            for b in self._free:
                b.release()
            self._free.clear()
