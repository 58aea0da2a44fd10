"""The catalog of an shm store: a partition's meta log, and one log per writer process (see storage.py).

    DIR/<pid>/log       the PartitionMeta, written once at create (logs.py's format)
    DIR/<pid>/logs/<n>  writer n's log: one record per committed put of that process, the ChunkRefs of its
                        blocks; a header says how far it is committed (logs.py)
    DIR/<pid>/claims    a byte per cell, set while or once a put of it commits (commit.py)

Why a log per writer: with one log, writers took turns on its flock to append, and each read the others'
records first to re-check write-once; with 4 writers on 2 cores a put spent half its time waiting. Now a
writer appends to its own log without a lock; write-once is kept by the claims (commit.py). A reader keeps
every log of a partition open and learns of new commits from their headers (one pread each) and of a new
writer from one open of the next log's name, and merges the records in the order it finds them (cells are
written once, so any order gives the same cells). A record is its length, then the xxh3 of its JSON and the
JSON (files.framed), so a damaged log is a CorruptChunkError, never wrong rows.
"""

from __future__ import annotations

import errno
import os
import shutil
import uuid

from dataplane_rl.errors import CorruptChunkError, PartitionExistsError, StoreUnavailableError
from dataplane_rl.store import chunks
from dataplane_rl.store.arrow import schema_of
from dataplane_rl.store.chunks import PID, ChunkRef, PartitionMeta, Snapshot
from dataplane_rl.store.shm.files import CHUNK_KEY, DIR_MODE, check_trusted, create_file, open_file, untrusted
from dataplane_rl.store.shm.logs import HEAD_BYTES, Tail, _head, _record, meta_text, parse_meta

__all__ = ["LOG", "Log", "ShmCatalog", "_head", "_record"]  # _head, _record: tests forge logs with them

LOG = "log"
LOGS = "logs"
CLAIMS = "claims"


class Log:
    """One process's view of a partition incarnation: its folder, open (the folder's descriptor names the
    incarnation: files opened through it are its own, even if the partition is dropped and made again
    meanwhile), the meta, every writer's log it follows (`tails`, by number; `mine`: this process's own,
    made at its first commit), the refs read so far (a list replaced, never changed, as commits arrive:
    snapshots handed out stay as they were) and their keys. The readers file, the logs folder and the claims
    are opened when first needed. Its files close when the last user lets go of it (a commit or a lease in
    flight keeps it)."""

    def __init__(self, folder: str, dir_fd: int, token: str) -> None:
        self.folder, self.dir_fd, self.token = folder, dir_fd, token
        self.path = os.path.join(folder, LOG)
        self.fd = self.readers_fd = self.logs_fd = self.claims_fd = -1
        self.meta: PartitionMeta | None = None
        self.tails: list[Tail] = []
        self.mine: Tail | None = None
        self.refs: list[ChunkRef] = []
        self.keys: set[str] = set()

    def open(self, name: str, flags: int, logs: bool = False) -> int:
        """A file of this incarnation's folder, or of its logs folder (trusted: the user's own, private, no
        symlink)."""
        dir_fd, folder = (self.logs(), os.path.join(self.folder, LOGS)) if logs else (self.dir_fd, self.folder)
        fd = open_file(name, flags, folder=folder, dir_fd=dir_fd)
        why = untrusted(os.path.join(folder, name), os.fstat(fd), folder=False)
        if why:
            os.close(fd)
            raise StoreUnavailableError(why)
        return fd

    def readers(self) -> int:
        if self.readers_fd < 0:
            self.readers_fd = self.open("readers", os.O_RDONLY)
        return self.readers_fd

    def logs(self) -> int:
        if self.logs_fd < 0:
            fd = open_file(LOGS, os.O_RDONLY | os.O_DIRECTORY, folder=self.folder, dir_fd=self.dir_fd)
            why = untrusted(os.path.join(self.folder, LOGS), os.fstat(fd), folder=True)
            if why:
                os.close(fd)
                raise StoreUnavailableError(why)
            self.logs_fd = fd
        return self.logs_fd

    def claims(self) -> int:
        """The claims, opened for reading and writing at this process's first commit."""
        if self.claims_fd < 0:
            self.claims_fd = self.open(CLAIMS, os.O_RDWR)
        return self.claims_fd

    def discover(self) -> None:
        """Open the writers' logs made since this process last looked: numbered from 0, each made whole
        before it gets its number (commit.py), so the first missing number ends the search."""
        while True:
            name = str(len(self.tails))
            try:
                fd = self.open(name, os.O_RDONLY, logs=True)
            except FileNotFoundError:
                return
            self.tails.append(Tail(fd, os.path.join(self.folder, LOGS, name)))

    def close(self) -> None:
        for tail in self.tails:
            tail.close()
        self.tails, self.mine = [], None
        for name in ("fd", "readers_fd", "logs_fd", "claims_fd", "dir_fd"):
            fd = getattr(self, name)
            if fd >= 0:
                setattr(self, name, -1)
                os.close(fd)

    __del__ = close


class ShmCatalog:
    """ShmStorage's catalog: create, snapshot, list (a mixin of storage.py's ShmStorage, whose folder, caches,
    locks and errors it uses)."""

    def create(self, meta: PartitionMeta) -> None:
        """Build the partition in a hidden folder, then rename it into place (atomic; refuses an existing
        one). The creator keeps its files open: it knows the meta, so its first put or get reads nothing."""
        tmp = os.path.join(self._dir, f".create-{uuid.uuid4().hex}")
        log = None
        try:
            with self._os_errors(f"create partition {meta.pid}"):
                for sub in ("", "chunks", LOGS):
                    os.mkdir(os.path.join(tmp, sub), DIR_MODE)
                record = _record(meta_text(meta))
                end = HEAD_BYTES + len(record)
                for name, data in (("readers", b""), (CLAIMS, b""), (LOG, _head(end).ljust(HEAD_BYTES, b"\0") + record)):
                    create_file(os.path.join(tmp, name), data)
                # a byte per cell, [num_rows, columns] row-major; a hole until a put claims its cells
                os.truncate(os.path.join(tmp, CLAIMS), meta.num_rows * len(schema_of(meta).names))
                pdir = os.path.join(self._dir, meta.pid)
                dfd = os.open(tmp, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW)
                log = Log(pdir, dfd, str(os.fstat(dfd).st_ino))
                log.fd = log.open(LOG, os.O_RDONLY)
                log.meta = PartitionMeta(meta.pid, meta.schema_json, meta.num_rows, log.token)
                try:
                    os.rename(tmp, pdir)
                except OSError as e:
                    if e.errno in (errno.EEXIST, errno.ENOTEMPTY):
                        raise PartitionExistsError(f"partition {meta.pid} already exists in {self.url}; drop it "
                                                   "first or use a new id") from None
                    raise
            with self._refs_lock:
                self._logs[meta.pid] = log
        except BaseException:
            if log is not None:
                log.close()
            shutil.rmtree(tmp, ignore_errors=True)
            raise

    def snapshot(self, pid: str) -> Snapshot:
        """The meta and the committed refs: a stat of the folder (its inode is the incarnation token: a
        partition dropped and made again is a new folder), a read of each writer log's header and one open
        to find a new writer; new records, each parsed once per process, with one more read each."""
        pdir = self._pdir(pid)
        try:
            token = str(os.lstat(pdir).st_ino)
        except (FileNotFoundError, NotADirectoryError):
            raise self.not_found(pid) from None
        with self._refs_lock:
            log = self._logs.get(pid)
            if log is None or log.token != token:
                log = self._logs[pid] = self._open_log(pid, pdir)
            else:
                self._follow(pid, log)
            return Snapshot(log.meta, log.refs)

    def _open_log(self, pid: str, pdir: str) -> Log:
        """First sight of a partition incarnation here: its folder, chunks and logs folders and its logs
        must be the store's own."""
        try:
            dfd = open_file(pdir, os.O_RDONLY | os.O_DIRECTORY)
        except (FileNotFoundError, NotADirectoryError):
            check_trusted(pdir)  # a symlink (O_DIRECTORY says ENOTDIR, not ELOOP) or a file is named as such
            raise self.not_found(pid) from None
        st = os.fstat(dfd)
        log = Log(pdir, dfd, str(st.st_ino))
        try:
            for path, where in ((pdir, st), (os.path.join(pdir, "chunks"), os.lstat("chunks", dir_fd=dfd))):
                why = untrusted(path, where, folder=True)
                if why:
                    raise StoreUnavailableError(why)
            log.fd = log.open(LOG, os.O_RDONLY)
            meta = Tail(log.fd, log.path)
            texts = meta.records(meta.committed())
            try:
                log.meta = parse_meta(texts[0], log.token)
            except (ValueError, KeyError, TypeError, IndexError) as e:
                raise CorruptChunkError(f"shm metadata {log.path} does not describe a partition ({e!r}); the "
                                        "partition cannot be trusted, drop it and regenerate the step") from None
            self._follow(pid, log)
        except BaseException as e:
            log.close()
            if isinstance(e, (FileNotFoundError, NotADirectoryError)):
                # a drop renames the folder whole: one still in place with a file missing is damaged, not
                # dropped (it was once "unknown or dropped" while listed live in the same line)
                if _same_folder(pdir, st):
                    raise CorruptChunkError(f"partition {pid} of {self.url} is damaged: "
                                            f"{os.path.join(pdir, e.filename or '')} is missing; the partition "
                                            "cannot be trusted, drop it and regenerate the step") from None
                raise self.not_found(pid) from None
            raise
        return log

    def _follow(self, pid: str, log: Log) -> None:
        """Read every writer log's new records into `log` (under the refs lock)."""
        log.discover()
        new: list[ChunkRef] = []
        keys = log.keys
        for tail in log.tails:
            end = tail.committed()
            if end == tail.end:
                continue
            for text in tail.records(end):
                refs = self._parse_refs(tail.path, text)
                # every put writes chunks under fresh keys: a key seen twice is a copied record, whose rows
                # would count (and read) twice
                again = next((r.key for r in refs if r.key in keys), None)
                if again is not None:
                    raise CorruptChunkError(f"shm log {tail.path} repeats chunk {again} of an earlier commit of "
                                            f"partition {pid}; the partition cannot be trusted, drop it")
                keys.update([r.key for r in refs])
                new += refs
            tail.end = end
        if new:
            log.refs = log.refs + new

    @staticmethod
    def _parse_refs(path: str, text: str) -> list[ChunkRef]:
        try:
            refs = chunks.refs_from_json(text)
        except (ValueError, KeyError, TypeError) as e:
            raise CorruptChunkError(f"shm log {path} does not hold chunk refs ({e!r})") from None
        for ref in refs:  # checksummed already; still, never join an unchecked name to a path
            if not CHUNK_KEY.fullmatch(ref.key) or ref.nbytes < 0:
                raise CorruptChunkError(f"shm log {path} names chunk key {ref.key!r}, not one this store writes; "
                                        "the partition cannot be trusted, drop it")
        return refs

    def list(self) -> list[str]:
        return [n for n in os.listdir(self._dir) if PID.fullmatch(n)]

    def _close_log(self, pid: str) -> None:
        """Forget what this process read of `pid`; its files close when no commit or lease still uses them."""
        with self._refs_lock:
            self._logs.pop(pid, None)


def _same_folder(path: str, st: os.stat_result) -> bool:
    """Whether `path` is still the folder `st` describes (not dropped, nor dropped and made again)."""
    try:
        now = os.lstat(path)
    except OSError:
        return False
    return (now.st_ino, now.st_dev) == (st.st_ino, st.st_dev)
