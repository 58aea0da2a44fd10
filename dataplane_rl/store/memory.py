"""`memory://`: an in-process store. Fast and simple; other processes cannot see it."""

from __future__ import annotations

import itertools
import threading

import pyarrow as pa

from dataplane_rl.errors import PartitionExistsError, PartitionNotFoundError
from dataplane_rl.store.base import ChunkRef, ColumnStore, PartitionMeta

_ids = itertools.count()


class MemoryStore(ColumnStore):
    scheme = "memory"

    def __init__(self, name: str = "") -> None:
        super().__init__()
        self._name = name or f"store{next(_ids)}"
        self._lock = threading.Lock()
        self._metas: dict[str, PartitionMeta] = {}
        self._refs: dict[str, list[ChunkRef]] = {}
        self._blobs: dict[str, pa.Buffer] = {}

    @property
    def url(self) -> str:
        return f"memory://{self._name}"

    def _create(self, meta: PartitionMeta) -> None:
        with self._lock:
            if meta.pid in self._metas:
                raise PartitionExistsError(f"partition {meta.pid} already exists in {self.url}; drop it first or "
                                           "use a new id")
            self._metas[meta.pid] = meta
            self._refs[meta.pid] = []

    def _meta(self, pid: str) -> PartitionMeta:
        try:
            return self._metas[pid]
        except KeyError:
            raise PartitionNotFoundError(f"partition {pid} is unknown or dropped in {self.url}; "
                                         f"live partitions: {sorted(self._metas) or 'none'}") from None

    def _chunks(self, pid: str) -> list[ChunkRef]:
        self._meta(pid)
        return list(self._refs[pid])

    def _write_chunks(self, pid, chunks) -> None:
        with self._lock:
            for ref, buf in chunks:
                self._blobs[ref.key] = buf

    def _commit(self, pid, refs) -> None:
        with self._lock:
            meta = self._meta(pid)
            err = self._conflicts(meta, self._refs[pid], refs)
            if err:
                raise err
            self._refs[pid] = self._refs[pid] + list(refs)

    def _discard(self, pid, refs) -> None:
        with self._lock:
            for ref in refs:
                self._blobs.pop(ref.key, None)

    def _read_chunks(self, pid, refs):
        return [self._blobs.get(r.key, b"") for r in refs]

    def _drop(self, pid: str) -> None:
        with self._lock:
            self._meta(pid)
            for ref in self._refs.pop(pid):
                self._blobs.pop(ref.key, None)
            del self._metas[pid]

    def _list(self) -> list[str]:
        return list(self._metas)

    def _close(self) -> None:
        self._metas.clear()
        self._refs.clear()
        self._blobs.clear()
