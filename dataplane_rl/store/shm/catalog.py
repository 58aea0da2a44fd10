"""The catalog of an shm store: one append-only log per partition (see shm.py).

    DIR/<pid>/log    a header (magic, the committed end, its checksum), then framed records up to that end:
                     record 0 the PartitionMeta, each later one the ChunkRefs of one committed put

Why a log: a refs file per put cost a new file, a rename and, in every process that followed the
partition, a failed open per call and an open, read and close per commit. Here a reader keeps the log
open and reads the header (one pread) to learn whether anything was committed, and the new records with
one more; a commit writes its record past the end, then moves the end, under the partition lock. A
writer that dies between the two leaves bytes past the end that nobody reads and the next commit
overwrites, so a reader only ever sees whole records. A record is its length, then the xxh3 of its JSON
and the JSON (files.framed), so a damaged log is a CorruptChunkError, never wrong rows.
"""

from __future__ import annotations

import errno
import json
import os
import shutil
import struct
import uuid

from dataplane_rl.errors import CorruptChunkError, PartitionExistsError, StoreUnavailableError
from dataplane_rl.store import chunks
from dataplane_rl.store.chunks import PID, ChunkRef, PartitionMeta, Snapshot, checksum
from dataplane_rl.store.files import (
    CHUNK_KEY,
    DIR_MODE,
    check_trusted,
    create_file,
    flocked,
    framed,
    open_file,
    unframe,
    untrusted,
)

LOG = "log"
_HEAD = struct.Struct("<8sQQ")  # magic, committed end, xxh3 of the end's 8 bytes
_MAGIC = b"dprl-log"
HEAD_BYTES = 64  # the first record starts here
_LEN = struct.Struct("<I")  # a record: its framed JSON's length, then the framed JSON


def _end_check(end: int) -> int:
    return checksum(end.to_bytes(8, "little"))


def _head(end: int) -> bytes:
    return _HEAD.pack(_MAGIC, end, _end_check(end))


def _record(text: str) -> bytes:
    body = framed(text)
    return _LEN.pack(len(body)) + body


def _meta_text(meta: PartitionMeta) -> str:
    """Record 0: a line of JSON (pid, num_rows), then the schema JSON verbatim, so a reader parses only
    the small line and decodes the schema once per process (schema_of caches by its text)."""
    return json.dumps({"pid": meta.pid, "num_rows": meta.num_rows}) + "\n" + meta.schema_json


def _parse_meta(text: str, token: str) -> PartitionMeta:
    head, _, schema_json = text.partition("\n")
    d = json.loads(head)
    if not schema_json.startswith("{"):
        raise ValueError("no schema after the first line")
    return PartitionMeta(d["pid"], schema_json, int(d["num_rows"]), token)


class Log:
    """One process's view of a partition incarnation: its folder and log, open (the folder's descriptor
    names the incarnation: files opened through it are its own, even if the partition is dropped and made
    again meanwhile), the meta, the refs read so far (a list replaced, never changed, as commits arrive:
    snapshots handed out stay as they were) and their keys. The readers file, and the log for writing (a
    committer's lock: an flock of it), are opened when first needed. Its files close when the last user
    lets go of it (a commit or a lease in flight keeps it)."""

    def __init__(self, folder: str, dir_fd: int, token: str) -> None:
        self.folder, self.dir_fd, self.token = folder, dir_fd, token
        self.path = os.path.join(folder, LOG)
        self.fd = self.readers_fd = self.write_fd = -1
        self.meta: PartitionMeta | None = None
        self.refs: list[ChunkRef] = []
        self.keys: set[str] = set()
        self.end = HEAD_BYTES  # how far this process has read

    def open(self, name: str, flags: int) -> int:
        """A file of this incarnation's folder (trusted: the user's own, private, no symlink)."""
        fd = open_file(name, flags, folder=self.folder, dir_fd=self.dir_fd)
        why = untrusted(os.path.join(self.folder, name), os.fstat(fd), folder=False)
        if why:
            os.close(fd)
            raise StoreUnavailableError(why)
        return fd

    def readers(self) -> int:
        if self.readers_fd < 0:
            self.readers_fd = self.open("readers", os.O_RDONLY)
        return self.readers_fd

    def writer(self) -> int:
        """The log opened for appending, at this process's first commit (`fd` is read-only: a read-only
        store can still be read)."""
        if self.write_fd < 0:
            self.write_fd = self.open(LOG, os.O_RDWR)
        return self.write_fd

    def committed(self) -> int:
        """The committed end, from the header. A header read while a commit rewrites it may mix the two
        (its checksum says so): read again."""
        for _ in range(100):
            magic, end, check = _HEAD.unpack(os.pread(self.fd, _HEAD.size, 0).ljust(_HEAD.size, b"\0"))
            if magic == _MAGIC and check == _end_check(end):
                return end
            if magic != _MAGIC:
                break
        raise CorruptChunkError(f"shm metadata {self.path} is damaged (no valid header); the partition cannot be "
                                "trusted, drop it and regenerate the step")

    def records(self, end: int) -> list[str]:
        """The JSON of each record from what this process has read up to `end`."""
        data = os.pread(self.fd, end - self.end, self.end) if end > self.end else b""
        if len(data) != end - self.end:
            raise CorruptChunkError(f"shm metadata {self.path} is damaged ({self.end + len(data)} bytes, the header "
                                    f"says {end}); the partition cannot be trusted, drop it and regenerate the step")
        out, at = [], 0
        while at < len(data):
            n = _LEN.unpack_from(data, at)[0] if at + _LEN.size <= len(data) else -1
            body = data[at + _LEN.size:at + _LEN.size + n] if n >= 0 else b""
            # a cut record reads as empty: unframe names the log as damaged
            out.append(unframe(body if len(body) == n else b"", f"{self.path} at {self.end + at}"))
            at += _LEN.size + n
        return out

    def close(self) -> None:
        for name in ("fd", "readers_fd", "write_fd", "dir_fd"):
            fd = getattr(self, name)
            if fd >= 0:
                setattr(self, name, -1)
                os.close(fd)

    __del__ = close


class ShmCatalog:
    """ShmStore's catalog hooks (a mixin: it uses the store's folder, caches, locks and error helpers)."""

    # -- catalog hooks ---------------------------------------------------------------------------
    def _create(self, meta: PartitionMeta) -> None:
        """Build the partition in a hidden folder, then rename it into place (atomic; refuses an existing
        one). The creator keeps its files open: it knows the meta, so its first put or get reads nothing."""
        tmp = os.path.join(self._dir, f".create-{uuid.uuid4().hex}")
        log = None
        try:
            with self._os_errors(f"create partition {meta.pid}"):
                for sub in ("", "chunks"):
                    os.mkdir(os.path.join(tmp, sub), DIR_MODE)
                record = _record(_meta_text(meta))
                end = HEAD_BYTES + len(record)
                for name, data in (("readers", b""), (LOG, _head(end).ljust(HEAD_BYTES, b"\0") + record)):
                    create_file(os.path.join(tmp, name), data)
                pdir = os.path.join(self._dir, meta.pid)
                dfd = os.open(tmp, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW)
                log = Log(pdir, dfd, str(os.fstat(dfd).st_ino))
                log.fd = log.open(LOG, os.O_RDONLY)
                log.meta, log.end = PartitionMeta(meta.pid, meta.schema_json, meta.num_rows, log.token), end
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

    def _snapshot(self, pid: str) -> Snapshot:
        """The meta and the committed refs: a stat of the folder (its inode is the incarnation token: a
        partition dropped and made again is a new folder) and a read of the log's header; new records,
        each parsed once per process, with one more read."""
        pdir = self._pdir(pid)
        try:
            token = str(os.lstat(pdir).st_ino)
        except (FileNotFoundError, NotADirectoryError):
            raise self._not_found(pid) from None
        with self._refs_lock:
            log = self._logs.get(pid)
            if log is None or log.token != token:
                log = self._logs[pid] = self._open_log(pid, pdir)
            end = log.committed()
            if end != log.end:
                self._follow(pid, log, end)
            return Snapshot(log.meta, log.refs)

    def _open_log(self, pid: str, pdir: str) -> Log:
        """First sight of a partition incarnation here: its folder, chunks folder and log must be the
        store's own."""
        try:
            dfd = open_file(pdir, os.O_RDONLY | os.O_DIRECTORY)
        except (FileNotFoundError, NotADirectoryError):
            check_trusted(pdir)  # a symlink (O_DIRECTORY says ENOTDIR, not ELOOP) or a file is named as such
            raise self._not_found(pid) from None
        st = os.fstat(dfd)
        log = Log(pdir, dfd, str(st.st_ino))
        try:
            for path, where in ((pdir, st), (os.path.join(pdir, "chunks"), os.lstat("chunks", dir_fd=dfd))):
                why = untrusted(path, where, folder=True)
                if why:
                    raise StoreUnavailableError(why)
            log.fd = log.open(LOG, os.O_RDONLY)
            self._follow(pid, log, log.committed())
        except BaseException as e:
            log.close()
            if isinstance(e, (FileNotFoundError, NotADirectoryError)):
                # a drop renames the folder whole: one still in place with a file missing is damaged, not
                # dropped (it was once "unknown or dropped" while listed live in the same line)
                if _same_folder(pdir, st):
                    raise CorruptChunkError(f"partition {pid} of {self.url} is damaged: "
                                            f"{os.path.join(pdir, e.filename or '')} is missing; the partition "
                                            "cannot be trusted, drop it and regenerate the step") from None
                raise self._not_found(pid) from None
            raise
        return log

    def _follow(self, pid: str, log: Log, end: int) -> None:
        """Read the records up to `end` into `log`: the meta first, then each put's refs."""
        new: list[ChunkRef] = []
        for text in log.records(end):
            if log.meta is None:
                try:
                    log.meta = _parse_meta(text, log.token)
                except (ValueError, KeyError, TypeError) as e:
                    raise CorruptChunkError(f"shm metadata {log.path} does not describe a partition ({e!r})") from None
                continue
            refs = self._parse_refs(log.path, text)
            # every put writes chunks under fresh keys: a key seen twice is a copied record, whose rows would
            # count (and read) twice
            again = next((r.key for r in refs if r.key in log.keys), None)
            if again is not None:
                raise CorruptChunkError(f"shm log {log.path} repeats chunk {again} of an earlier commit of "
                                        f"partition {pid}; the partition cannot be trusted, drop it")
            log.keys.update(r.key for r in refs)
            new += refs
        if log.meta is None:
            raise CorruptChunkError(f"shm metadata {log.path} is damaged (no partition record); the partition cannot "
                                    "be trusted, drop it and regenerate the step")
        if new:
            log.refs = log.refs + new
        log.end = end

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

    def _commit(self, meta: PartitionMeta, refs: list[ChunkRef], seen: list[ChunkRef] | None = None) -> None:
        pid = meta.pid
        with self._refs_lock:
            log = self._logs.get(pid)
        if log is None or log.token != meta.token:
            self._snapshot(pid)
            with self._refs_lock:
                log = self._logs[pid]
        if log.token != meta.token:
            raise self._not_found(pid, "was dropped while this put was writing (nothing was written)")
        # an flock of the log keeps other processes out (a drop too: it takes the same lock); the thread
        # lock, other threads of this one, which share the descriptor
        with self._commit_lock:
            with self._os_errors(f"commit a put to partition {pid}"):
                try:
                    fd = log.writer()
                except FileNotFoundError:
                    raise self._not_found(pid, "was dropped while this put was writing (nothing was written)") from None
            self._append(pid, log, fd, refs, seen)

    def _append(self, pid: str, log: Log, fd: int, refs: list[ChunkRef], seen: list[ChunkRef] | None) -> None:
        """The commit under the partition's lock: follow what others committed, check, append, move the end."""
        with flocked(fd):
            try:
                if str(os.lstat(log.folder).st_ino) != log.token:
                    raise FileNotFoundError
            except (FileNotFoundError, NotADirectoryError):
                raise self._not_found(pid, "was dropped while this put was writing (nothing was written)") from None
            with self._refs_lock:
                end = log.committed()  # under the lock: every commit so far
                if end != log.end:
                    self._follow(pid, log, end)
                snap = Snapshot(log.meta, log.refs)
            err = self._conflict(snap, refs) if snap.refs is not seen else None  # else the put's own check stands
            if err:
                raise err
            record = _record(chunks.refs_to_json(refs))
            end = log.end + len(record)
            with self._os_errors(f"commit a put to partition {pid}"):
                if os.pwrite(fd, record, log.end) != len(record):  # past the end: no reader looks there
                    raise OSError(errno.ENOSPC, "short write", log.path)
                os.pwrite(fd, _head(end), 0)  # the commit: one small write of a page that exists
            with self._refs_lock:  # our own commit: no read back
                log.keys.update(r.key for r in refs)
                log.refs, log.end = snap.refs + list(refs), end

    def _list(self) -> list[str]:
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
