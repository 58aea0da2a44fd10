"""The data-plane switch (docs/architecture.md §4.3), in one module: how columns travel between driver and actors.

Data plane on (`data_plane.enabled=true`): every actor opens the run's store by URL and reads and writes
its own rows; the driver passes row sets and reads per-sample scalars only. Off: the driver's in-process
store holds every column; it fetches each actor's inputs, hands them over by reference, and writes back
what the actor returns. `DriverTransport` is the driver's side (here), `ActorIO` the actors'
(columns/actor_io.py). No other module asks whether the data plane is on.
"""

from __future__ import annotations

import time

import numpy as np
import pyarrow as pa

from dataplane_rl.errors import StoreTimeoutError
from dataplane_rl.ray_calls import get_all
from dataplane_rl.columns.rowsets import fetch, write

# store.wait slices: between two, the driver checks that the rollout jobs it waits for have not failed
WAIT_SLICE_S = 1.0


class DriverTransport:
    """The driver's side: `store` is the run's store (on) or the driver's MemoryStore (off)."""

    def __init__(self, store, enabled: bool) -> None:
        self.store = store
        self.url: str | None = store.url if enabled else None  # what actors open; None: they open nothing

    def call(self, workers: list, method: str, jobs: list, fields=None) -> list:
        """`method(job)` on every worker with its job: a row set, or a list of row sets (one per optimizer
        step). Off: the driver fetches each job's `fields` (None: the method reads no column) and passes them
        along, and writes back a returned table. Returns the workers' results."""
        if self.url:
            return get_all([getattr(w, method).remote(j) for w, j in zip(workers, jobs)])
        if fields is None:
            outs = get_all([getattr(w, method).remote(j) for w, j in zip(workers, jobs)])
        else:
            tables = [[fetch(self.store, rs, fields) for rs in j] if _is_steps(j) else fetch(self.store, j, fields)
                      for j in jobs]
            outs = get_all([getattr(w, method).remote(j, t) for w, j, t in zip(workers, jobs, tables)])
        for j, out in zip(jobs, outs):
            if isinstance(out, pa.Table):
                write(self.store, j, out)
        return outs

    def collect(self, pid: str, jobs: list[tuple[np.ndarray, object]], fields, timeout: float) -> list[dict]:
        """Block until the rollout jobs [(rows, Ray future)] of partition `pid` are in; returns their receipts.

        On: the store's own readiness (`wait` on `fields`), in slices; between slices a job whose call
        failed (a dead actor, a failed put) raises its error at once instead of waiting out the timeout.
        Off: the rows travel as the calls' results, so it waits on those and writes them to the driver's
        store. Raises StoreTimeoutError after `timeout` seconds."""
        import ray

        futures = [f for _, f in jobs]
        deadline = time.monotonic() + timeout
        if self.url:
            rows = np.concatenate([r for r, _ in jobs])
            while True:
                try:
                    self.store.wait(pid, fields, rows, timeout=max(0.0, min(WAIT_SLICE_S, deadline - time.monotonic())))
                    break
                except StoreTimeoutError:
                    done, _ = ray.wait(futures, num_returns=len(futures), timeout=0)
                    # raises the error of a job that failed; a job's failed groups are never written
                    failed = [r for _, receipt in ray.get(done) for r in receipt.get("failed_rows", ())]
                    rows = np.setdiff1d(rows, failed) if failed else rows
                    if time.monotonic() >= deadline:
                        raise
        else:
            _, missing = ray.wait(futures, num_returns=len(futures), timeout=timeout)
            if missing:
                raise StoreTimeoutError(f"partition {pid}: {len(missing)} of {len(futures)} rollout jobs not done "
                                        f"after {timeout:g} s")
        results = ray.get(futures)
        for (rows, _), (table, receipt) in zip(jobs, results):
            if table is not None:
                failed = receipt.get("failed_rows")  # a failed group's rows: never written (rollout/retries.py)
                write(self.store, [(pid, np.setdiff1d(rows, failed) if failed else rows)], table)
        return [receipt for _, receipt in results]


def _is_steps(job: list) -> bool:
    return bool(job) and isinstance(job[0], list)
