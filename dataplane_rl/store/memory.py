"""`memory://`: an in-process store. Fast and simple; other processes cannot see it."""

from __future__ import annotations

import itertools
import threading
import uuid

import pyarrow as pa

from dataplane_rl.errors import PartitionExistsError
from dataplane_rl.store import chunks
from dataplane_rl.store.base import ColumnStore
from dataplane_rl.store.chunks import ChunkRef, PartitionMeta, Snapshot
from dataplane_rl.store.storage import Staged, Storage

_ids = itertools.count()


class MemoryStore(ColumnStore):
    scheme = "memory"

    def __init__(self, name: str = "") -> None:
        super().__init__(MemoryStorage(name or f"store{next(_ids)}"))


class MemoryStorage(Storage):
    """Metas, refs and block bytes in this process's dicts, under one lock."""

    def __init__(self, name: str) -> None:
        self.name = name
        self._lock = threading.Lock()
        self._metas: dict[str, PartitionMeta] = {}
        self._refs: dict[str, list[ChunkRef]] = {}
        self._blobs: dict[str, pa.Buffer] = {}

    @property
    def url(self) -> str:
        return f"memory://{self.name}"

    def create(self, meta: PartitionMeta) -> None:
        with self._lock:
            if meta.pid in self._metas:
                raise PartitionExistsError(f"partition {meta.pid} already exists in {self.url}; drop it first or "
                                           "use a new id")
            self._metas[meta.pid] = PartitionMeta(meta.pid, meta.schema_json, meta.num_rows, uuid.uuid4().hex)
            self._refs[meta.pid] = []

    def snapshot(self, pid: str) -> Snapshot:
        with self._lock:
            meta = self._metas.get(pid)
            if meta is None:
                raise self.not_found(pid)
            return Snapshot(meta, self._refs[pid])  # the list is replaced on commit, never changed

    def store(self, meta, blocks) -> Staged:
        refs = []
        try:
            for block in blocks:
                buf, digests = chunks.encode_block(block)
                ref = ChunkRef.of(block, f"{meta.pid}/{meta.token}/{uuid.uuid4().hex}", digests)
                with self._lock:
                    self._blobs[ref.key] = buf
                refs.append(ref)
        except BaseException:
            self.discard(meta, refs)
            raise
        return Staged(refs)

    def commit(self, meta, staged, seen, conflict) -> None:
        refs = staged.refs
        with self._lock:
            live = self._metas.get(meta.pid)
            if live is None or live.token != meta.token:
                raise self.not_found(meta.pid)
            committed = self._refs[meta.pid]
            err = conflict(Snapshot(live, committed), refs)
            if err:
                raise err
            self._refs[meta.pid] = committed + list(refs)

    def discard(self, meta, refs) -> None:
        with self._lock:
            keep = {r.key for r in self._refs.get(meta.pid, [])}
            for ref in refs:
                if ref.key not in keep:
                    self._blobs.pop(ref.key, None)

    def read(self, pid, refs):
        return [self._blobs.get(r.key, pa.py_buffer(b"")) for r in refs]

    def drop(self, pid: str) -> None:
        with self._lock:
            if pid not in self._metas:
                raise self.not_found(pid)
            for ref in self._refs.pop(pid):
                self._blobs.pop(ref.key, None)
            del self._metas[pid]

    def list(self) -> list[str]:
        return list(self._metas)

    def close(self) -> None:
        self._metas.clear()
        self._refs.clear()
        self._blobs.clear()
