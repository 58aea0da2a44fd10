"""An actor's side of the data-plane switch: its rows' columns from the store (on) or from the driver (off)."""

from __future__ import annotations

import time

import numpy as np
import pyarrow as pa

from dataplane_rl import trace
from dataplane_rl.columns.rowsets import RowSet, fetch, write


class ActorIO:
    """An actor's column movement, with the bytes and seconds it spent for the step's data_plane/ metrics."""

    def __init__(self, store_url: str | None) -> None:
        self.store = None
        if store_url:
            from dataplane_rl.store import open_store

            self.store = open_store(store_url)
        self.io = {"bytes_read": 0, "bytes_written": 0, "get_s": 0.0, "put_s": 0.0}

    def fetch(self, rs: RowSet, fields, table: pa.Table | None) -> pa.Table:
        """The fields of the row set: from the store (on) or the table the driver handed over (off)."""
        if table is None:
            t0 = time.perf_counter()
            with trace.span("get") as args:
                table = fetch(self.store, rs, fields)
                args["bytes"] = table.nbytes
            self.io["get_s"] += time.perf_counter() - t0
            self.io["bytes_read"] += table.nbytes
        return table.select(list(fields))

    def emit(self, rs: RowSet, table: pa.Table) -> pa.Table | None:
        """Put the row set's new columns (on: returns None) or return them for the driver to write (off)."""
        if self.store is None:
            return table
        t0 = time.perf_counter()
        with trace.span("put") as args:
            args["bytes"] = write(self.store, rs, table)
        self.io["bytes_written"] += args["bytes"]
        self.io["put_s"] += time.perf_counter() - t0
        return None

    def emit_missing(self, pid: str, rows: np.ndarray, table: pa.Table) -> tuple[pa.Table | None, int]:
        """A retried job's columns (faults/rollout_actors.py): on, put only the cells of `rows` its first attempt did
        not commit (cells are written once), by column; returns (table or None as emit does, rows written)."""
        if self.store is None:
            return table, table.num_rows
        todo: dict[bytes, list[str]] = {}  # the positions still missing -> the columns missing exactly there
        for name in table.column_names:
            missing = np.flatnonzero(~np.isin(rows, self.store.ready(pid, [name])))
            todo.setdefault(missing.astype(np.int64).tobytes(), []).append(name)
        written = 0
        for key, names in todo.items():
            pos = np.frombuffer(key, dtype=np.int64)
            if pos.size:
                self.emit([(pid, rows[pos])], table.select(names).take(pa.array(pos)))
                written = max(written, int(pos.size))
        return None, written

    def take(self) -> dict:
        out, self.io = self.io, {k: 0 * v for k, v in self.io.items()}
        return out

    def close(self) -> None:
        if self.store is not None:
            self.store.close()
            self.store = None
