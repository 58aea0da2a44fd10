"""Which committed block holds each cell: per column, the block index and position of every row.

Built once per partition incarnation and extended as commits arrive (refs are append-only), so put,
get, ready and wait look cells up with numpy indexing instead of re-walking every ref per call. The
per-row arrays are built when first asked for: a get of rows that one block holds (most gets of a
partition of a few puts) finds that block from the refs alone (`tiling`).
"""

from __future__ import annotations

import threading
from typing import Any

import numpy as np

from dataplane_rl.store.chunks import ChunkRef, is_run


class RowIndex:
    """owner[column][row]: index into `refs` of the block holding the cell (-1: unwritten); pos: its row
    position in that block."""

    def __init__(self, num_rows: int) -> None:
        self.num_rows = num_rows
        self.refs: list[ChunkRef] = []
        self.first: list[int] = []  # per ref: its first row if its rows are one increasing run, else -1
        self._owner: dict[str, np.ndarray] = {}  # column -> [num_rows] int32
        self._pos: dict[str, np.ndarray] = {}  # column -> [num_rows] int32
        self._built = 0  # refs[:_built] are in the per-row arrays
        # column -> (owner [K, num_rows], pos [K, num_rows], k): columns first written by one block share
        # one pair of 2-D arrays (owner[column] is row k), so a block of K columns is two numpy writes
        self._rows: dict[str, tuple[np.ndarray, np.ndarray, int]] = {}
        # [num_rows] int64: the length column's values this process has read (checksummed) so far, -1 where
        # not read. Cells are written once, so a value read stays right for this incarnation; a put of token
        # columns without the length column checks against it instead of reading the blocks again.
        self.lengths: np.ndarray | None = None
        self._learned: list[tuple[slice | np.ndarray, np.ndarray]] = []  # (rows, values) not yet in `lengths`
        self.lock = threading.Lock()

    def extends(self, refs: list[ChunkRef]) -> bool:
        """Is `refs` this index's refs plus newer ones? Backends keep refs append-only per incarnation and
        reuse the objects they parsed, so the first and last known ones being the same objects says so."""
        n = len(self.refs)
        return n == 0 or (len(refs) >= n and refs[0] is self.refs[0] and refs[n - 1] is self.refs[n - 1])

    def add(self, refs: list[ChunkRef]) -> None:
        self.refs += refs
        if len(refs) < 8:
            self.first += [at.start if isinstance(at := as_slice(r.rows), slice) else -1 for r in refs]
            return
        # a reader's first sight of a partition: hundreds of refs, tested for one run each in a few numpy
        # calls over all their rows, not as_slice's few per ref
        parts = [r.rows for r in refs]
        sizes = np.array([p.size for p in parts], dtype=np.int64)  # [R]
        rows = np.concatenate(parts)  # [N]
        if not rows.size:
            self.first += [-1] * len(refs)
            return
        ends = np.cumsum(sizes)  # [R]
        starts = np.minimum(ends - sizes, rows.size - 1)  # [R] (an empty ref's: any row, it is no run)
        # breaks[j]: how many of rows 1..j are not the row before + 1; a ref is one run if none inside it is
        breaks = np.zeros(rows.size, dtype=np.int64)  # [N]
        np.cumsum(rows[1:] != rows[:-1] + 1, out=breaks[1:])
        run = (sizes > 0) & (breaks[np.maximum(ends - 1, 0)] == breaks[starts])  # [R]
        self.first += np.where(run, rows[starts], -1).tolist()

    @property
    def owner(self) -> dict[str, np.ndarray]:
        self._build()
        return self._owner

    @property
    def pos(self) -> dict[str, np.ndarray]:
        self._build()
        return self._pos

    def tiling(self, columns: list[str], a: int, b: int) -> list[tuple[list[tuple[int, int, int]], list[int]]] | None:
        """How `columns` lie on rows a..b-1 (a < b) if, for each, the blocks holding it there each hold one run
        of rows (puts of ranges; such a block holds every cell of its run, and each cell is written once):
        per distinct sequence of blocks, its blocks in row order as (block, first position, end position) and
        the positions in `columns` it holds. Else None. From the refs, without the per-row arrays while they
        are not built and the refs are few (one block must then hold the rows); else from them."""
        found: dict[Any, tuple[list[tuple[int, int, int]], list[int]]] = {}
        if self._built < len(self.refs) and len(self.refs) <= 8:
            for i, c in enumerate(columns):
                k = next((k for k, (ref, first) in enumerate(zip(self.refs, self.first))
                          if 0 <= first <= a and b <= first + ref.rows.size and c in ref.columns), -1)
                if k < 0:
                    return None
                found.setdefault(k, ([(k, a - self.first[k], b - self.first[k])], []))[1].append(i)
            return list(found.values())
        first = self.first
        for i, c in enumerate(columns):
            owner = self.owner.get(c)
            if owner is None:
                return None
            which = owner[a:b]  # [b-a]
            key = which.tobytes()  # columns written by the same puts share their blocks
            if key not in found:
                cut = (np.flatnonzero(which[1:] != which[:-1]) + 1).tolist()
                blocks = which[[0, *cut]].tolist()
                if min(blocks) < 0 or min(first[k] for k in blocks) < 0:
                    return None
                ends = [a + c for c in cut]
                found[key] = ([(k, lo - first[k], hi - first[k]) for k, lo, hi in zip(blocks, [a, *ends], [*ends, b])],
                              [])
            found[key][1].append(i)
        return list(found.values())

    def _build(self) -> None:
        """Bring the per-row arrays up to date with the refs added since: per set of columns, one numpy write
        of all its new refs' rows (a reader's first sight of a partition brings hundreds of refs)."""
        if self._built == len(self.refs):  # the common call (every lookup asks): nothing new
            return
        refs, todo = self.refs, {}  # columns -> indices of new refs of them
        last: tuple[str, ...] = ()
        for i in range(self._built, len(refs)):
            cols = refs[i].columns
            if cols != last:  # most refs are of the columns of the one before (a tuple compare, no hash)
                last = cols
                new = todo.get(cols)
                if new is None:
                    new = todo[cols] = []
                    fresh = [c for c in cols if c not in self._rows]
                    if fresh:
                        owner = np.full((len(fresh), self.num_rows), -1, dtype=np.int32)  # [K, num_rows]
                        pos = np.zeros((len(fresh), self.num_rows), dtype=np.int32)  # [K, num_rows]
                        for k, c in enumerate(fresh):
                            self._rows[c] = (owner, pos, k)
                            self._owner[c], self._pos[c] = owner[k], pos[k]
            new.append(i)
        for cols, new in todo.items():
            at: slice | np.ndarray
            if len(new) == 1:
                i = new[0]
                n, first = refs[i].rows.size, self.first[i]
                # a block of consecutive rows (every put of a range) is written by slice, not by fancy index
                at = slice(first, first + n) if first >= 0 else refs[i].rows
                which, where = np.int32(i), np.arange(n, dtype=np.int32)
            else:
                parts = [refs[i].rows for i in new]
                sizes = np.array([p.size for p in parts], dtype=np.int64)  # [R]
                at = np.concatenate(parts)  # [N]
                which = np.repeat(np.array(new, dtype=np.int32), sizes)  # [N]
                where = (np.arange(at.size) - np.repeat(np.cumsum(sizes) - sizes, sizes)).astype(np.int32)  # [N]
            bases: dict[int, tuple[np.ndarray, np.ndarray, list[int]]] = {}
            for c in cols:
                owner, pos, k = self._rows[c]
                bases.setdefault(id(owner), (owner, pos, []))[2].append(k)
            for owner, pos, ks in bases.values():
                if len(ks) == owner.shape[0]:
                    ix = (slice(None), at)
                elif isinstance(at, slice):
                    ix = (ks, at)
                else:
                    ix = np.ix_(ks, at)
                owner[ix] = which
                pos[ix] = where
        self._built = len(refs)

    def known_lengths(self, rows: np.ndarray) -> np.ndarray | None:
        """The length column's values on `rows` if this process has read all of them, else None."""
        self._fold()
        if self.lengths is None:
            return None
        got = self.lengths[rows]
        return got if not got.size or int(got.min()) >= 0 else None

    def learn_lengths(self, rows: np.ndarray, values: np.ndarray) -> None:
        """Remember the length column's values on `rows`, as a get just read them (a copy: the get's
        buffers must not outlive its arrays). Kept as given until a put asks (most readers never do)."""
        self._learned.append((as_slice(rows), np.array(values)))
        if len(self._learned) > 64:  # a process that reads and reads: bounded
            self._fold()

    def _fold(self) -> None:
        if self._learned:
            if self.lengths is None:
                self.lengths = np.full(self.num_rows, -1, dtype=np.int64)
            for at, values in self._learned:
                self.lengths[at] = values
            self._learned.clear()

    def written(self, column: str, rows: np.ndarray | slice) -> np.ndarray:
        """The rows of `rows` (ids, or a slice of them) on which `column` is written."""
        owner = self.owner.get(column)
        if isinstance(rows, slice):
            if owner is None or int(owner[rows].max(initial=-1)) < 0:  # the common case: none
                return np.zeros(0, dtype=np.int64)
            rows = np.arange(rows.start, rows.stop, dtype=np.int64)
        return rows[:0] if owner is None else rows[owner[rows] >= 0]

    def any_written(self, columns: tuple[str, ...] | list[str], rows: np.ndarray | slice) -> bool:
        """Is any cell of `columns` x `rows` written? One numpy lookup per group of columns sharing their
        arrays (a put's columns, first written together), not one per column: a commit asks this of every
        put, against every other writer's commits."""
        self._build()
        bases: dict[int, tuple[np.ndarray, list[int]]] = {}
        for c in columns:
            got = self._rows.get(c)
            if got is not None:
                bases.setdefault(id(got[0]), (got[0], []))[1].append(got[2])
        for owner, ks in bases.values():
            if len(ks) == owner.shape[0]:
                cells = owner[:, rows]
            else:
                cells = owner[ks, rows] if isinstance(rows, slice) else owner[np.ix_(ks, rows)]
            if cells.size and int(cells.max()) >= 0:
                return True
        return False

    def unwritten(self, column: str, rows: np.ndarray) -> np.ndarray:
        owner = self.owner.get(column)
        return rows if owner is None else rows[owner[rows] < 0]

    def ready(self, columns: list[str]) -> np.ndarray:
        """Rows (sorted int64) on which every column is written."""
        mask = None
        for c in columns:
            owner = self.owner.get(c)
            if owner is None:
                return np.zeros(0, dtype=np.int64)
            m = owner >= 0
            mask = m if mask is None else mask & m
        return np.flatnonzero(mask).astype(np.int64) if mask is not None else np.zeros(0, dtype=np.int64)


def as_slice(rows: np.ndarray) -> np.ndarray | slice:
    """`rows` as a slice if they are one increasing run (a put of a range), else as they are."""
    n = rows.size
    return slice(int(rows[0]), int(rows[0]) + n) if n and is_run(rows) else rows


def overlap(index: RowIndex, refs: list[ChunkRef]) -> tuple[str, np.ndarray] | None:
    """The first (column, rows) of `refs` already written in `index`, or None: one lookup per column."""
    by_cols: dict[tuple[str, ...], list[np.ndarray]] = {}
    for ref in refs:
        by_cols.setdefault(ref.columns, []).append(ref.rows)
    for cols, parts in by_cols.items():
        rows = parts[0] if len(parts) == 1 else np.concatenate(parts)
        rows = as_slice(rows)
        if not index.any_written(cols, rows):  # the common answer, in one lookup
            continue
        for col in cols:
            hit = index.written(col, rows)
            if hit.size:
                return col, np.sort(hit)
    return None
