"""`bench store`'s small calls: µs per put and get of a 64-row batch, the fixed cost a streaming step pays."""

from __future__ import annotations

import time
from typing import Any

from dataplane_rl.bench.store_work import _stats, bench_fields, bench_schema, make_batch, payload_bytes


def small_calls(store, min_len: int, max_len: int, repeats: int, pool=None, rows: int = 64,
                full_puts: int = 200, topk: int = 0) -> dict[str, Any]:
    """µs per put and per get of `rows` rows (a GRPO step of 8 groups of 8) of DP_TRAIN_FIELDS: the fixed
    cost per call that the streaming trainer's many small puts and reads pay.
    - put, get: into a fresh partition and back, in this process;
    - remote_get: the same rows read by another process (`pool`'s reader 0), which first sees the
      partition then;
    - put_full, remote_get_full: a put into a partition already holding `full_puts` puts, and its rows
      read by the other process."""
    batch = make_batch(rows, min_len, max_len, seed=1, topk=topk)
    schema, fields = bench_schema(topk), bench_fields(topk)
    puts, gets, remote = [], [], []

    def remote_get(pid: str, lo: int, hi: int) -> float:
        r = pool.ask(0, ("rows", pid, lo, hi))
        return (r["t1"] - r["t0"]) * 1e6

    for k in range(repeats + 1):  # call 0 warms up
        pid = f"bench-small-{k:04d}"
        store.create_partition(pid, schema, rows)
        t0 = time.perf_counter()
        store.put(pid, batch, range(rows))
        t1 = time.perf_counter()
        table = store.get(pid, fields, range(rows))
        t2 = time.perf_counter()
        assert table.num_rows == rows
        del table
        r = remote_get(pid, 0, rows) if pool is not None else None
        store.drop_partition(pid)
        if k:
            puts.append((t1 - t0) * 1e6)
            gets.append((t2 - t1) * 1e6)
            if r is not None:
                remote.append(r)
    out = {"rows": rows, "bytes": payload_bytes(batch), "put_us": _stats(puts), "get_us": _stats(gets)}
    if pool is not None:
        out["remote_get_us"] = _stats(remote)
    # A streaming step: many small puts into one partition, each read by the other process as it lands.
    # Pass 0 is the run's first such step (every put in new pages); pass 1 the steady one, whose puts
    # reuse what pass 0's partition gave back when dropped. Timed: the puts after the first `full_puts`.
    for step in range(2):
        full, full_remote = [], []
        pid = f"bench-small-full-{step}"
        store.create_partition(pid, schema, rows * (full_puts + repeats))
        try:
            for k in range(full_puts + repeats):
                lo = k * rows
                t0 = time.perf_counter()
                store.put(pid, batch, range(lo, lo + rows))
                t1 = time.perf_counter()
                r = remote_get(pid, lo, lo + rows) if pool is not None else None
                if k >= full_puts:
                    full.append((t1 - t0) * 1e6)
                    if r is not None:
                        full_remote.append(r)
        finally:
            store.drop_partition(pid)
        suffix = "" if step else "_first_step"
        out[f"put_full{suffix}_us"] = _stats(full)
        if pool is not None:
            out[f"remote_get_full{suffix}_us"] = _stats(full_remote)
    out["full_puts"] = full_puts
    return out
