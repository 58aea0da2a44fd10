"""The storage of an `shm://DIR` store (docs/architecture.md §5.3): a folder on /dev/shm that every process of one
machine shares.

A store is a folder, on /dev/shm so the bytes live in RAM. `shm://` alone makes a fresh folder that the
store removes on close (unless `keep()` is called); `shm://DIR` opens (or makes) DIR and leaves it in place.

    DIR/.dataplane-rl                  marker: this folder is a store
    DIR/.owner                         the process that made it, and whether it is kept (owners.py)
    DIR/.kept                          made once by keep(): the folder outlives its run (owners.py)
    DIR/.pool/<bytes>-<hex>            segments of dropped partitions (and pre-touched ones), kept for reuse
    DIR/<pid>/log                      the partition's meta (catalog.py); flock'd by a drop
    DIR/<pid>/logs/<n>                 writer process n's committed puts' ChunkRefs, appended by it alone;
                                       a header says how far it is committed (logs.py)
    DIR/<pid>/claims                   a byte per cell, set by a commit under a byte-range lock of its
                                       rows: write-once without writers taking turns (commit.py);
                                       locked whole by a drop
    DIR/<pid>/readers                  flock'd shared by each process still mapping this partition
    DIR/<pid>/chunks/put-<hex>         a segment (arena.py): the blocks of one or more puts of one writer,
                                       each every column of its rows as flat buffers (chunks.py) at a
                                       64-byte-aligned offset; key put-<hex>@<offset>

Folders are 0700 and files 0600: the store is private to its user. Each record of a log starts with the
xxh3 of its text, so a damaged one is a CorruptChunkError, never wrong rows. Space for a put
is reserved (posix_fallocate) before its file is mapped, so a full /dev/shm is a StoreFullError instead
of a SIGBUS in the writer.

A put copies each column buffer straight into the next free range of its writer's open segment of the
partition, kept mapped (one copy, no claim, map or rename per put: arena.py); checksums go per column
and piece, so a shard reader checksums only what it reads. It becomes visible when its record is appended
to its writer's own log, after claiming its cells (commit.py); a writer that dies before that leaves only
unreferenced bytes, freed with the partition. While it writes, a
put holds a shared flock on its segment, so a drop never pools a segment that a put still writes. A
process keeps each log it follows open and learns of new commits from their headers (one read each),
never by listing. A get maps the chunk files and returns zero-copy Arrow buffers. Drop renames the folder away
under the meta log's flock and a lock of every claim, so no new reader finds it, while open mappings stay readable. The file pool is in
pool.py, the per-process maps and leases in maps.py.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import os
import shutil
import threading
import uuid
import weakref
from pathlib import Path
from typing import Iterator

import pyarrow as pa

from dataplane_rl.errors import ConfigError, CorruptChunkError, StoreFullError, StoreUnavailableError
from dataplane_rl.store import chunks
from dataplane_rl.store.shm import owners
from dataplane_rl.store.chunks import PID, Block, ChunkRef, PartitionMeta, layout, split_key
from dataplane_rl.store.storage import Staged, Storage
from dataplane_rl.store.shm.arena import DEFAULT_ARENA, DEFAULT_PREFAULT, DEFAULT_SEGMENT, Arena, MiB
from dataplane_rl.store.shm.catalog import Log, ShmCatalog
from dataplane_rl.store.shm.commit import GONE, ShmCommit, range_lock
from dataplane_rl.store.shm.files import (
    DIR_MODE,
    OSErrorsAs,
    check_trusted,
    create_file,
    framed,
    open_file,
    read_file,
    unframe,
)
from dataplane_rl.store.shm.maps import Lease, Maps
from dataplane_rl.store.shm.pool import Pool

_MARKER = owners.MARKER
_FORMAT = b"dataplane-rl shm store v5\n"  # v5: a log per writer and claims; v4: one log, flat buffers
_POOL = ".pool"
_STATS = ".stats"  # each process's counters (stats.py), for `store ls`
DEFAULT_POOL_BYTES = 1 << 30
# URL options: name -> (default, what it is, in the error for a bad one)
OPTIONS = {"pool_bytes": (DEFAULT_POOL_BYTES, "bytes of dropped segments kept for reuse"),
           "arena_mb": (DEFAULT_ARENA // MiB, "MiB the store's segments may hold in all, data_plane.shm.arena_mb"),
           "prefault_mb": (DEFAULT_PREFAULT // MiB, "MiB of pages made ready when the store is made, "
                           "data_plane.shm.prefault_mb")}


class ShmStorage(ShmCommit, ShmCatalog, Storage):
    """The folder, this process's view of its partitions (logs, maps, leases) and its segments; the catalog
    is catalog.py's, the commit commit.py's."""

    checks_alone = True  # the claims keep cells write-once at commit (commit.py)

    def __init__(self, path: str | os.PathLike | None, *, pool_bytes: int, arena_mb: int, prefault_mb: int,
                 create: bool) -> None:
        self._auto = not path
        if self._auto and not create:
            raise ConfigError("shm:// without a folder makes a new, empty store; to open an existing one give its "
                              "folder: shm:///dev/shm/dataplane-rl-...")
        if self._auto:
            path = owners.new_auto_path()
        self._dir = os.path.abspath(path)
        for key, value in (("pool_bytes", pool_bytes), ("arena_mb", arena_mb), ("prefault_mb", prefault_mb)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ConfigError(f"shm store {self._dir}: {key}={value!r} must be a non-negative integer "
                                  f"({OPTIONS[key][1]})")
        self._pool_bytes, self._arena_mb, self._prefault_mb = pool_bytes, arena_mb, prefault_mb
        made = self._open_dir(create)
        self._maps = Maps(pool_bytes)
        self._logs: dict[str, Log] = {}  # pid -> what this process read of its log (catalog.py)
        self._refs_lock = threading.RLock()
        self._commit_lock = threading.Lock()
        self._pool = Pool(os.path.join(self._dir, _POOL), pool_bytes)
        self._arena = Arena(self._dir, self._pool, arena_mb * MiB, DEFAULT_SEGMENT)
        if made:  # pages the first round writes into; pooled, so bounded by pool_bytes
            self._arena.prefault(min(prefault_mb * MiB, pool_bytes))
        self._leases: weakref.WeakValueDictionary[str, Lease] = weakref.WeakValueDictionary()
        self._stats_name = f"{os.getpid()}-{os.urandom(6).hex()}.json"
        # An auto folder lives as long as the store that made it, even if close() is never called.
        self._cleanup = weakref.finalize(self, shutil.rmtree, self._dir, True) if self._auto else None

    @property
    def url(self) -> str:
        mine = {"pool_bytes": self._pool_bytes, "arena_mb": self._arena_mb, "prefault_mb": self._prefault_mb}
        extra = "&".join(f"{k}={v}" for k, v in mine.items() if v != OPTIONS[k][0])
        return f"shm://{self._dir}" + (f"?{extra}" if extra else "")

    @property
    def path(self) -> Path:
        return Path(self._dir)

    def keep(self) -> None:
        """Leave the folder in place at close, even one made for `shm://` (data_plane.keep_partitions)."""
        if self._cleanup is not None:
            self._cleanup.detach()
            self._cleanup = None
            owners.mark_kept(self._dir)  # `store gc` must leave it

    def _open_dir(self, create: bool) -> bool:
        """Open the store folder, or make it (True)."""
        marker = os.path.join(self._dir, _MARKER)
        if os.path.lexists(self._dir) and not os.path.islink(self._dir) and not os.path.isdir(self._dir):
            raise StoreUnavailableError(f"shm://{self._dir} names a file, not a folder; point shm:// at a store "
                                        "folder or a new path")
        if check_trusted(self._dir):  # before anything is read or written there
            if check_trusted(marker, folder=False):
                fd = open_file(marker, os.O_RDONLY)
                with os.fdopen(fd, "rb") as f:
                    version = f.read(64)
                if version != _FORMAT:  # v1: no metadata checksums; v2: a chunk per column; v3: Arrow IPC blocks
                    raise StoreUnavailableError(f"shm store {self._dir} was made by an older dataplane-rl (format "
                                                f"{version.decode(errors='replace').strip()!r}, this one writes "
                                                f"{_FORMAT.decode().strip()!r}); make a new store (drop this folder)")
                check_trusted(os.path.join(self._dir, _POOL))
                return False
        if not create:
            why = (f"{marker} is missing" if os.path.isdir(self._dir) else "the folder does not exist: a store's "
                   "folder goes with `dataplane-rl store drop --all` and with the run that made it, unless kept")
            raise StoreUnavailableError(f"no shm store at {self._dir} ({why}); check the URL")
        if os.path.isdir(self._dir) and any(not n.startswith(".") for n in os.listdir(self._dir)):
            raise ConfigError(f"{self._dir} holds files but is not a dataplane-rl store; point shm:// at a new "
                              "or empty folder")
        with self._os_errors("make the store folder"):
            os.makedirs(self._dir, mode=DIR_MODE, exist_ok=True)
            check_trusted(self._dir)  # made by another user between the check above and ours?
            os.chmod(self._dir, DIR_MODE)
            os.makedirs(os.path.join(self._dir, _POOL), mode=DIR_MODE, exist_ok=True)
            check_trusted(os.path.join(self._dir, _POOL))
            owners.write_owner(self._dir, auto=self._auto)  # before the marker: no store is without an owner
            try:
                create_file(marker, _FORMAT)
            except FileExistsError:  # another process made the store meanwhile
                return False
        return True

    def _os_errors(self, what: str, need: int = 0, pid: str = "") -> OSErrorsAs:
        """A full or unwritable filesystem as the store's own errors, naming the folder (and the bytes).
        `pid`: appended to `what` (the message is only made if there is an error)."""
        return OSErrorsAs(self._os_error, what, pid, need)

    def _os_error(self, e: OSError, what: str, need: int) -> None:
        """Raise the store's own error for `e`, if it has one (else the caller re-raises `e`)."""
        if e.errno == errno.ENOSPC:
            raise self._full(what, need) from None
        if e.errno in (errno.EACCES, errno.EPERM, errno.EROFS, errno.EEXIST, errno.ENOTDIR):
            raise StoreUnavailableError(f"shm store {self._dir}: cannot {what}: {e.strerror} ({e.filename}); "
                                        "use a writable folder of your own") from None

    def _full(self, what: str, need: int) -> StoreFullError:
        try:
            st = os.statvfs(self._dir)
            free = f"{st.f_bavail * st.f_frsize} bytes free of {st.f_blocks * st.f_frsize}"
        except OSError:
            free = "free space unknown"
        asked = f"{need} bytes asked, " if need else ""
        return StoreFullError(f"shm store {self._dir} is full: cannot {what} ({asked}{free}); nothing of it was "
                              "kept. Drop partitions, lower pool_bytes, or give the filesystem more room")
    # -- paths and locks -------------------------------------------------------------------------
    def _pdir(self, pid: str) -> str:
        if not isinstance(pid, str) or not PID.fullmatch(pid):  # also keeps '../x' out of the folder
            raise self.not_found(pid)
        return f"{self._dir}/{pid}"

    @contextlib.contextmanager
    def _locked(self, pid: str) -> Iterator[str]:
        """Hold the partition's lock (an flock of its meta log) and every claim byte (commit.py: the
        commits in flight end first, and later ones wait); raise PartitionNotFoundError if it is (or gets)
        dropped."""
        pdir = self._pdir(pid)
        lock = os.path.join(pdir, "log")
        try:
            fd = open_file(lock, os.O_RDONLY)
        except (FileNotFoundError, NotADirectoryError):
            raise self.not_found(pid) from None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            try:  # dropped (and maybe re-created) between open and flock?
                live = os.stat(lock).st_ino == os.fstat(fd).st_ino
            except FileNotFoundError:
                live = False
            if not live:
                raise self.not_found(pid)
            try:
                claims = open_file(os.path.join(pdir, "claims"), os.O_RDWR)
            except FileNotFoundError:  # a damaged partition: dropped all the same
                claims = -1
            try:
                if claims >= 0:
                    range_lock(claims, fcntl.F_WRLCK, 0, 0)
                yield pdir
            finally:
                if claims >= 0:
                    os.close(claims)  # lets go of its lock
        finally:
            os.close(fd)

    def _lease(self, pid: str) -> Lease:
        """This process's lease on the partition it just read the catalog of (one at a time per partition)."""
        with self._refs_lock:
            log = self._logs.get(pid)
            if log is None:
                raise self.not_found(pid)
            lease = self._leases.get(pid)
            if lease is None or lease.owner is not log:
                try:
                    lease = self._leases[pid] = Lease(log, log.readers())
                except BlockingIOError:  # a drop holds it right now
                    raise self.not_found(pid) from None
        return lease

    # -- blocks -----------------------------------------------------------------------------------
    def store(self, meta: PartitionMeta, blocks: list[Block]) -> Staged:
        """Write every block of the put in place into the next free range of this process's open segment
        of the partition, each at an aligned offset with its own checksums."""
        pid = meta.pid  # checked: it came from the catalog
        offsets, end = layout(blocks)
        pdir = f"{self._dir}/{pid}"
        folder = f"{pdir}/chunks"
        try:
            with self._os_errors("write a put of partition", max(end, 1), pid):
                name, base, _ = self._arena.place(pid, meta.token, folder, end)
        except FileNotFoundError:
            raise self.not_found(pid, GONE) from None
        path, out = f"{folder}/{name}", []
        try:
            f = self._maps.take(path, base + end, writable=True)
            try:
                # a shared flock on the segment while the put writes into it (pool.take_back), which a drop
                # must win to pool the segment: a partition still here now cannot pool this segment (to
                # another writer) before the write ends
                fcntl.flock(f.fileno(), fcntl.LOCK_SH)
                try:
                    if str(os.lstat(pdir).st_ino) != meta.token:
                        raise FileNotFoundError(pdir)
                    f.prepare(base, end)
                    for block, off in zip(blocks, offsets):
                        at = base + off
                        digests = chunks.write_block(f.array[at:at + block.nbytes], block)
                        out.append(ChunkRef.of(block, f"{name}@{at}", digests))
                finally:
                    fcntl.flock(f.fileno(), fcntl.LOCK_UN)
            finally:
                self._maps.keep(f)
        except BaseException as e:
            self._give_back(pid, name, base, end)
            if isinstance(e, FileNotFoundError):
                raise self.not_found(pid, GONE) from None
            raise
        return Staged(out)

    def _give_back(self, pid: str, name: str, base: int, end: int) -> None:
        """A put placed at `base` of segment `name` failed: its range goes back to the segment, and a
        segment made for it alone goes."""
        if self._arena.done(pid, name, base, end, ok=False):
            with contextlib.suppress(OSError):
                os.unlink(os.path.join(self._pdir(pid), "chunks", name))

    def discard(self, meta: PartitionMeta, refs: list[ChunkRef]) -> None:
        try:
            # an interrupt that lands just after the commit must not give back committed ranges
            keep = {r.key for r in self.snapshot(meta.pid).refs}
        except Exception:
            return
        if not refs or any(r.key in keep for r in refs):
            return
        name, base = split_key(refs[0].key)  # layout() put the put's first block at its range's start
        end = split_key(refs[-1].key)[1] + refs[-1].nbytes - base
        with contextlib.suppress(Exception):
            self._give_back(meta.pid, name, base, end)

    def read(self, pid: str, refs: list[ChunkRef]) -> list[pa.Buffer]:
        lease = self._lease(pid)
        folder = f"{self._pdir(pid)}/chunks"
        by_file: dict[str, list[tuple[int, int, int]]] = {}  # file -> (index in refs, offset, nbytes)
        for i, ref in enumerate(refs):
            file, off = split_key(ref.key)
            by_file.setdefault(file, []).append((i, off, ref.nbytes))
        empty = pa.py_buffer(b"")
        out: list[pa.Buffer] = [empty] * len(refs)  # a committed chunk without its bytes: reported as missing
        for file, parts in by_file.items():
            path = f"{folder}/{file}"
            try:
                # never map or read past the end of the file (SIGBUS); a short chunk fails its checksum
                st = os.lstat(path)
                need = min(max(off + n for _, off, n in parts), st.st_size)
                if need <= 0:
                    continue
                with self._maps.file(path, need, writable=False, st=st) as f:
                    for i, off, n in parts:  # the cache lends each file to one caller at a time
                        n = min(n, st.st_size - off)
                        if n > 0:
                            buf = f.buffer(off, n)
                            out[i] = pa.foreign_buffer(buf.address, buf.size, base=(buf, lease))
            except FileNotFoundError:
                if not os.path.isdir(folder):
                    raise self.not_found(pid, "was dropped while reading") from None
        return out

    def drop(self, pid: str) -> None:
        trash = os.path.join(self._dir, f".drop-{uuid.uuid4().hex}")
        with self._locked(pid) as pdir, self._os_errors(f"drop partition {pid}"):
            os.rename(pdir, trash)
        self._close_log(pid)
        self._arena.forget(pid)
        self._pool.take_back(trash)

    def forget(self, pid: str) -> None:
        self._close_log(pid)
        self._arena.forget(pid)

    def close(self) -> None:
        with self._refs_lock:
            for log in self._logs.values():
                log.close()
            self._logs.clear()
        self._maps.close()
        self._arena.clear()
        if self._cleanup is not None:
            self._cleanup()

    # -- inspection ------------------------------------------------------------------------------
    def pool_bytes(self) -> int:
        """Bytes of dropped chunk files held for reuse (counted in /dev/shm usage)."""
        return self._pool.bytes()

    def gauges(self) -> dict[str, float]:
        allocated = self._arena.bytes_used() - (pooled := self._pool.bytes())
        cap = self._arena.limit_bytes
        p = "dataplane_store_arena_"
        return {p + "capacity_bytes": cap, p + "allocated_bytes": allocated, p + "pooled_bytes": pooled,
                p + "free_bytes": max(0, cap - allocated)}

    def share_counters(self, metrics: dict[str, float], final: bool) -> None:
        """DIR/.stats/<pid>-<hex>.json: this process's counters, rewritten (by rename) at most every second
        and at close, so `store ls` in another process adds up every process of the store."""
        if not any(metrics.values()):
            return
        folder = os.path.join(self._dir, _STATS)
        with contextlib.suppress(FileExistsError):
            os.mkdir(folder, DIR_MODE)
        check_trusted(folder)
        tmp = os.path.join(folder, f".{self._stats_name}-{os.urandom(4).hex()}")
        create_file(tmp, framed(json.dumps(metrics)))
        os.rename(tmp, os.path.join(folder, self._stats_name))

    def other_counters(self) -> dict[str, float]:
        from dataplane_rl.store.stats import add

        total: dict[str, float] = {}
        folder = os.path.join(self._dir, _STATS)
        with contextlib.suppress(FileNotFoundError):
            check_trusted(folder)
            for name in os.listdir(folder):
                if name.startswith(".") or name == self._stats_name:
                    continue
                path = os.path.join(folder, name)
                with contextlib.suppress(OSError, ValueError, CorruptChunkError):  # a damaged file counts nothing
                    add(total, json.loads(unframe(read_file(path), path)))
        return total
