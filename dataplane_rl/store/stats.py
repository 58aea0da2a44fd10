"""A store's counters: puts and gets with their bytes and seconds, refusals by cause, in Prometheus names.

Names follow what Mooncake's master, TransferQueue and Ray export (docs/store.md lists them):
`_total` for counters, `_seconds` for durations, `_bytes` for sizes, a `cause` label on refusals. A process
counts its own calls (a lock and a few additions per call); a backend whose processes share a folder (shm)
also writes them there, so `dataplane-rl store ls` adds up every process of the store.
"""

from __future__ import annotations

import re
import threading
import time
from dataclasses import dataclass
from typing import Iterable, Mapping

from dataplane_rl.errors import DataPlaneError, PartitionNotFoundError

PREFIX = "dataplane_store_"
COUNTERS = ("puts_total", "put_bytes_total", "put_seconds_total", "gets_total", "get_bytes_total",
            "get_seconds_total", "retries_total")  # retries: transient backend answers tried again
REFUSALS = PREFIX + "refusals_total"
_CALL_KEYS = {op: (f"{op}s_total", f"{op}_bytes_total", f"{op}_seconds_total") for op in ("put", "get")}
FLUSH_EVERY_S = 1.0  # how often a process writes its counters where other processes can add them up


def cause_of(error: BaseException) -> str:
    """'DuplicateWriteError' -> 'duplicate_write': the `cause` label of a refusal."""
    name = type(error).__name__
    name = name.removesuffix("Error")
    return re.sub(r"(?<!^)(?=[A-Z])", "_", name).lower()


class Counters:
    """This process's counts of one store's calls (what `ColumnStore.stats()` starts from)."""

    def __init__(self) -> None:
        self.values = dict.fromkeys(COUNTERS, 0)
        self.values.update({"put_seconds_total": 0.0, "get_seconds_total": 0.0})
        self.refusals: dict[str, int] = {}
        self._lock = threading.Lock()
        self.flushed = float("-inf")  # the first call shares at once: a short-lived writer shows up too

    def call(self, op: str, nbytes: int, seconds: float) -> None:
        calls, moved, secs = _CALL_KEYS[op]
        with self._lock:
            v = self.values
            v[calls] += 1
            v[moved] += nbytes
            v[secs] += seconds

    def retry(self) -> None:
        with self._lock:
            self.values["retries_total"] += 1

    def refused(self, error: BaseException) -> None:
        cause = cause_of(error)
        with self._lock:
            self.refusals[cause] = self.refusals.get(cause, 0) + 1

    def due(self) -> bool:
        """Time to write the counters out (at most every FLUSH_EVERY_S)?"""
        now = time.monotonic()
        if now - self.flushed < FLUSH_EVERY_S:
            return False
        self.flushed = now
        return True

    def metrics(self) -> dict[str, float]:
        with self._lock:
            out = {PREFIX + k: v for k, v in self.values.items()}
            out.update({f'{REFUSALS}{{cause="{c}"}}': n for c, n in sorted(self.refusals.items())})
        return out


def add(total: dict[str, float], more: Mapping[str, float]) -> dict[str, float]:
    """Counters of several processes, added up by name."""
    for k, v in more.items():
        if isinstance(v, (int, float)) and not isinstance(v, bool):
            total[k] = total.get(k, 0) + v
    return total


@dataclass
class PartitionStatus:
    """Rows written per column (of num_rows) and stored bytes per column."""

    pid: str
    schema: str
    num_rows: int
    rows_written: dict[str, int]
    nbytes: dict[str, int]

    @property
    def total_bytes(self) -> int:
        return sum(self.nbytes.values())

    def complete(self, fields: Iterable[str]) -> bool:
        return all(self.rows_written.get(f, 0) == self.num_rows for f in fields)


def of_store(store, partitions: Iterable[str] | None, counters, gauges) -> dict[str, float]:
    """`ColumnStore.stats()`: `counters()` (this process's, plus those other processes shared), the cells and
    bytes of the live `partitions` (default: every one), and the backend's `gauges()`. A damaged partition is
    counted in `damaged_partitions`, not raised: one bad partition must not hide the rest (`store ls`)."""
    out = counters()
    cells = free = used = damaged = 0
    parts = store.list_partitions() if partitions is None else list(partitions)
    for pid in parts:
        try:
            st = store.status(pid)
        except PartitionNotFoundError:  # dropped meanwhile
            continue
        except DataPlaneError:  # damaged (a CorruptChunkError, an untrusted file): `store ls` names it
            damaged += 1
            continue
        cells += sum(st.rows_written.values())
        free += st.num_rows * len(st.rows_written) - sum(st.rows_written.values())
        used += st.total_bytes
    p = PREFIX
    out.update({p + "partitions": len(parts), p + "cells_used": cells, p + "cells_free": free,
                p + "used_bytes": used, p + "damaged_partitions": damaged})
    out.update(gauges())
    return out
