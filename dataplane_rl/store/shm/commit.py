"""How an shm put commits without making writers take turns (catalog.py has the files, logs.py the format).

Each writer process appends its puts' records to its own log (DIR/<pid>/logs/<n>, made at its first commit
and numbered by the first free name, taken with link(): atomic, and never a half-written log). Write-once
is kept by the claims, DIR/<pid>/claims: a byte per cell, [num_rows, columns] row-major. A commit

    1. takes an OFD byte-range lock of its rows' claim bytes (writers of other rows do not wait);
    2. reads them: none set (the common case) -> no cell of the put is committed, nothing else is read;
       one set -> a put of that cell committed, or a writer died or failed between 3 and 4: only then the
       writers' logs are read, and the exact check against the committed refs decides;
    3. sets them,
    4. appends its record to its own log and moves that log's end (the commit point),
    5. and lets go of the range lock (the kernel lets go for a writer that dies).

So two puts of one cell commit one after the other, the second sees the first's claim, and a reader, who
reads only the logs, sees a put whole or not at all. A failed append clears the claims it set; a killed
writer's claims stay and cost the next put of those cells one exact check. A drop locks every claim byte
(storage.py `_locked`) before it renames the partition away, so it waits for the commits in flight, and a
commit that gets its range lock after a drop finds the folder gone.
"""

from __future__ import annotations

import fcntl
import os
import struct
import uuid
from functools import lru_cache

import numpy as np

from dataplane_rl.store import chunks
from dataplane_rl.store.arrow import schema_of
from dataplane_rl.store.chunks import ChunkRef, PartitionMeta, Snapshot
from dataplane_rl.store.shm.files import open_file
from dataplane_rl.store.shm.catalog import LOGS, Log
from dataplane_rl.store.shm.logs import Tail, empty_log
from dataplane_rl.store.storage import Conflict, Staged

_FLOCK = struct.Struct("hhqqi4x")  # Linux's struct flock: type, whence, start, len, pid (0 for OFD locks)
_SPAN = 1 << 20  # claim bytes a commit reads in one piece; rows spread wider are read run by run
GONE = "was dropped while this put was writing (nothing was written)"


@lru_cache(maxsize=1024)
def _claim_row(schema_json: str, columns: tuple[str, ...]) -> np.ndarray:
    """[columns of the schema] uint8: 1 at a put's columns. A row of claims ANDed (a check) or ORed (a
    claim) with it: no fancy indexing per commit."""
    names = schema_of(PartitionMeta("x", schema_json, 0)).names
    row = np.zeros(len(names), dtype=np.uint8)
    row[[names.index(c) for c in columns]] = 1
    row.flags.writeable = False
    return row


def range_lock(fd: int, kind: int, start: int, length: int) -> None:
    """Take (F_WRLCK) or let go of (F_UNLCK) an OFD lock (owned by the open file, not the process: two stores of one process exclude each other,
    and closing another descriptor of the file does not let go of it) of claim bytes start..start+length (length 0: to the end)."""
    fcntl.fcntl(fd, fcntl.F_OFD_SETLKW, _FLOCK.pack(kind, os.SEEK_SET, start, length, 0))


class ShmCommit:
    """ShmStorage's commit (a mixin of storage.py's ShmStorage, over ShmCatalog: it uses their logs, locks and
    errors)."""

    def known_snapshot(self, pid: str) -> Snapshot | None:
        """What this process knows of the partition: a put needs no more, its commit checks the claims and,
        under the claims' lock, that the folder is still this incarnation (a stale one: the put fails with
        PartitionNotFoundError before committing anything, and the store looks the partition up again)."""
        with self._refs_lock:
            log = self._logs.get(pid)
        return None if log is None else Snapshot(log.meta, log.refs)

    def commit(self, meta: PartitionMeta, staged: Staged, seen: list[ChunkRef], conflict: Conflict) -> None:
        """Steps 1-5 of the module doc. `seen` is not used: the claims say whether anything needs checking."""
        pid, refs = meta.pid, staged.refs
        with self._refs_lock:
            log = self._logs.get(pid)
        if log is None or log.token != meta.token:
            self.snapshot(pid)
            with self._refs_lock:
                log = self._logs[pid]
        if log.token != meta.token:
            raise self.not_found(pid, GONE)
        cols = _claim_row(meta.schema_json, refs[0].columns)  # a put's blocks all hold its columns
        width = cols.size
        rows = refs[0].rows if len(refs) == 1 else np.concatenate([r.rows for r in refs])
        if chunks.is_run(rows):  # a put of a range: the common case, no arithmetic over its rows
            lo, hi = int(rows[0]), int(rows[-1]) + 1
            runs = [(lo, hi, slice(0, hi - lo))]
        else:
            lo, hi = int(rows.min()), int(rows.max()) + 1
            if (hi - lo) * width <= _SPAN:
                runs = [(lo, hi, rows - lo)]
            else:  # rows scattered over a large partition: their claims, not every byte between them
                runs = [(a, b, slice(0, b - a)) for a, b in chunks.rows_to_spans(np.sort(rows))]
        # other threads of this process share its log and descriptors
        with self._commit_lock:
            with self._os_errors("commit a put to partition", 0, pid):
                try:
                    mine, claims = self._my_log(log), log.claims()
                except FileNotFoundError:
                    raise self.not_found(pid, GONE) from None
            start, length = lo * width, (hi - lo) * width
            range_lock(claims, fcntl.F_WRLCK, start, length)
            try:
                # a drop locks every claim (store.py _locked): holding ours, the folder is still this
                # incarnation, and stays so until we let go
                try:
                    if str(os.lstat(log.folder).st_ino) != log.token:
                        raise FileNotFoundError
                except (FileNotFoundError, NotADirectoryError):
                    raise self.not_found(pid, GONE) from None
                self._claim_and_append(pid, log, mine, refs, claims, width, runs, cols, conflict)
            finally:
                range_lock(claims, fcntl.F_UNLCK, start, length)

    def _claim_and_append(self, pid: str, log: Log, mine: Tail, refs: list[ChunkRef], claims: int, width: int,
                          runs: list, cols: np.ndarray, conflict: Conflict) -> None:
        """Steps 2-4 of the module doc, under the range lock; `runs`: (first row, end row, the put's rows
        among them) of each stretch of claims read and written."""
        parts, taken = [], False
        with self._os_errors("commit a put to partition", 0, pid):
            for a, b, at in runs:
                buf = bytearray((b - a) * width)
                os.preadv(claims, [buf], a * width)  # a hole (or a short file) reads as unclaimed
                fresh = buf.count(0) == len(buf)  # no cell of these rows claimed yet: the common case, no numpy
                cells = np.frombuffer(buf, dtype=np.uint8).reshape(-1, width)  # [b - a, columns]
                taken = taken or not fresh and bool((cells[at] & cols).any())
                parts.append((a * width, buf, cells, at, fresh))
        if taken:  # claimed: committed, or claimed by a put that never committed
            with self._refs_lock:
                self._follow(pid, log)
                snap = Snapshot(log.meta, log.refs)
            err = conflict(snap, refs)
            if err:
                raise err
        before = [bytes(buf) for _, buf, _, _, _ in parts]
        text = chunks.refs_to_json(refs)
        with self._os_errors("commit a put to partition", 0, pid):
            try:
                for start, buf, cells, at, fresh in parts:
                    if fresh and type(at) is slice:  # every row of the stretch, none claimed: the claim row repeated
                        buf[:] = cols.tobytes() * (len(buf) // width)
                    else:
                        cells[at] |= cols
                    os.pwrite(claims, buf, start)
                with self._refs_lock:  # a snapshot in another thread must not read our record as another's
                    mine.end = mine.append(text)
                    log.keys.update(r.key for r in refs)
                    log.refs = log.refs + list(refs)
            except BaseException:
                for (start, _, _, _, _), old in zip(parts, before):  # not committed: the cells are free again
                    os.pwrite(claims, old, start)
                raise

    def _my_log(self, log: Log) -> Tail:
        """This process's log of the partition, made at its first commit: written whole under a hidden
        name, then linked to the first free number (link refuses a taken one), so a reader never finds a
        numbered log without its header."""
        if log.mine is not None:
            return log.mine
        logs = log.logs()
        tmp = f".new-{uuid.uuid4().hex}"
        fd = open_file(tmp, os.O_RDWR | os.O_CREAT | os.O_EXCL, folder=os.path.join(log.folder, LOGS), dir_fd=logs)
        try:
            os.pwrite(fd, empty_log(), 0)
            with self._refs_lock:
                self._follow(log.meta.pid, log)  # the logs numbered so far, opened in order
                n = len(log.tails)
                while True:
                    try:
                        os.link(tmp, str(n), src_dir_fd=logs, dst_dir_fd=logs, follow_symlinks=False)
                        break
                    except FileExistsError:
                        n += 1
                log.discover()  # the logs numbered meanwhile, before ours; it opens ours (and any later) too
                for tail in log.tails[n:]:
                    tail.close()
                del log.tails[n:]
                if len(log.tails) < n:  # numbered, yet gone: the folder was dropped
                    raise FileNotFoundError(tmp)
                log.mine = Tail(fd, os.path.join(log.folder, LOGS, str(n)))
                log.tails.append(log.mine)
        except BaseException:
            os.close(fd)
            raise
        finally:
            os.unlink(tmp, dir_fd=logs)
        return log.mine
