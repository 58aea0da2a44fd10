"""The catalog of an shm store: partition folders, their meta.json and numbered refs files (see shm.py)."""

from __future__ import annotations

import contextlib
import errno
import json
import os
import shutil
import uuid

from dataplane_rl.errors import CorruptChunkError, PartitionExistsError
from dataplane_rl.store import chunks
from dataplane_rl.store.chunks import PID, ChunkRef, PartitionMeta, Snapshot
from dataplane_rl.store.shm_files import (
    CHUNK_KEY,
    DIR_MODE,
    check_trusted,
    create_file,
    framed,
    read_file,
    unframe,
)


def _meta_text(meta: PartitionMeta) -> str:
    """meta.json's body: a line of JSON (pid, num_rows), then the schema JSON verbatim, so a reader
    parses only the small line and decodes the schema once per process (schema_of caches by its text)."""
    return json.dumps({"pid": meta.pid, "num_rows": meta.num_rows}) + "\n" + meta.schema_json


def _parse_meta(text: str, token: str) -> PartitionMeta:
    head, _, schema_json = text.partition("\n")
    d = json.loads(head)
    if not schema_json.startswith("{"):
        raise ValueError("no schema after the first line")
    return PartitionMeta(d["pid"], schema_json, int(d["num_rows"]), token)


class ShmCatalog:
    """ShmStore's catalog hooks (a mixin: it uses the store's folder, caches, locks and error helpers)."""

    # -- catalog hooks ---------------------------------------------------------------------------
    def _create(self, meta: PartitionMeta) -> None:
        tmp = os.path.join(self._dir, f".create-{uuid.uuid4().hex}")
        try:
            with self._os_errors(f"create partition {meta.pid}"):
                for sub in ("", "refs", "chunks"):
                    os.mkdir(os.path.join(tmp, sub), DIR_MODE)
                for name, data in (("lock", b""), ("readers", b""), ("meta.json", framed(_meta_text(meta)))):
                    create_file(os.path.join(tmp, name), data)
                try:
                    os.rename(tmp, os.path.join(self._dir, meta.pid))  # atomic; refuses an existing (non-empty) one
                    ino = os.stat(os.path.join(self._dir, meta.pid)).st_ino
                    self._metas[meta.pid] = PartitionMeta(meta.pid, meta.schema_json, meta.num_rows, str(ino))
                except OSError as e:
                    if e.errno in (errno.EEXIST, errno.ENOTEMPTY):
                        raise PartitionExistsError(f"partition {meta.pid} already exists in {self.url}; drop it "
                                                   "first or use a new id") from None
                    raise
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise

    def _snapshot(self, pid: str) -> Snapshot:
        """The meta (cached: it never changes; a partition dropped and made again is a new folder, a new
        inode, and the inode is the token) and the refs files, each parsed once: a stat and a listdir."""
        pdir = self._pdir(pid)
        try:
            st = os.lstat(pdir)
            ino = st.st_ino
            cached = self._metas.get(pid)
            if cached is not None and cached.token == str(ino):
                meta = cached
            else:  # first sight of this partition here: it and its folders must be the store's own
                for folder in (pdir, os.path.join(pdir, "refs"), os.path.join(pdir, "chunks")):
                    check_trusted(folder)
                path = os.path.join(pdir, "meta.json")
                text = unframe(read_file(path), path)
                try:
                    meta = _parse_meta(text, str(ino))
                except (ValueError, KeyError, TypeError) as e:
                    raise CorruptChunkError(f"shm metadata {path} does not describe a partition ({e!r})") from None
                self._metas[pid] = meta
        except (FileNotFoundError, NotADirectoryError):
            raise self._not_found(pid) from None
        with self._refs_lock:
            token, refs, n, keys = self._refs_cache.get(pid, (meta.token, [], 0, set()))
            if token != meta.token:
                refs, n, keys = [], 0, set()
            grown = None  # the cached list stays as callers saw it; a copy grows
            while True:  # commits are numbered: the next one not there yet ends the list (one failed open)
                path = self._refs_path(pdir, n)
                try:
                    new = self._load_refs(path)
                except (FileNotFoundError, NotADirectoryError):
                    break
                # every put writes chunks under fresh keys: a key seen twice is a copied refs file, whose
                # rows would count (and read) twice. `keys`: every key of the cached refs (kept, not rebuilt
                # per commit, so following a partition of many puts stays linear)
                again = next((r.key for r in new if r.key in keys), None)
                if again is not None:
                    self._refs_cache.pop(pid, None)  # `keys` may hold keys of files not in the cache's refs
                    raise CorruptChunkError(f"shm refs file {path} repeats chunk {again} of an earlier commit of "
                                            f"partition {pid}; the partition cannot be trusted, drop it")
                keys.update(r.key for r in new)
                grown = (grown if grown is not None else list(refs)) + new
                n += 1
            if grown is not None:
                refs = grown
            self._refs_cache[pid] = (meta.token, refs, n, keys)
        return Snapshot(meta, refs)

    @staticmethod
    def _refs_path(pdir: str, n: int) -> str:
        return os.path.join(pdir, "refs", f"{n:010d}.json")

    @staticmethod
    def _load_refs(path: str) -> list[ChunkRef]:
        text = unframe(read_file(path), path)
        try:
            refs = chunks.refs_from_json(text)
        except (ValueError, KeyError, TypeError) as e:
            raise CorruptChunkError(f"shm refs file {path} does not hold chunk refs ({e!r})") from None
        for ref in refs:  # checksummed already; still, never join an unchecked name to a path
            if not CHUNK_KEY.fullmatch(ref.key) or ref.nbytes < 0:
                raise CorruptChunkError(f"shm refs file {path} names chunk key {ref.key!r}, not one this store "
                                        "writes; the partition cannot be trusted, drop it")
        return refs

    def _commit(self, meta: PartitionMeta, refs: list[ChunkRef]) -> None:
        pid = meta.pid
        with self._locked(pid) as pdir:
            with self._refs_lock:  # the snapshot and its cache entry together (another thread may forget it)
                snap = self._snapshot(pid)
                _, _, n, keys = self._refs_cache[pid]  # n: the next number, under the partition lock
            if snap.meta.token != meta.token:
                raise self._not_found(pid, "was dropped while this put was writing (nothing was written)")
            err = self._conflict(snap, refs)
            if err:
                raise err
            target, tmp = self._refs_path(pdir, n), os.path.join(pdir, f".refs-{os.urandom(16).hex()}")
            try:
                with self._os_errors(f"commit a put to partition {pid}"):
                    create_file(tmp, framed(chunks.refs_to_json(refs)))
                    os.rename(tmp, target)  # atomic; only the lock holder writes number n
            except BaseException:
                with contextlib.suppress(OSError):
                    os.unlink(tmp)
                raise
            with self._refs_lock:  # our own commit: no parse
                keys.update(r.key for r in refs)
                self._refs_cache[pid] = (meta.token, snap.refs + list(refs), n + 1, keys)

    def _list(self) -> list[str]:
        return [n for n in os.listdir(self._dir) if PID.fullmatch(n)]
