"""Column-store throughput in the pattern of an RL step: one writer process, R reader processes, a
GRPO-shaped batch, a new partition every round.

The batch holds DP_TRAIN_FIELDS with their declared dtypes (`--topk K`: and a teacher's top-k log-probs and ids,
[L, K] per row, the heaviest columns a distillation step moves); row lengths are drawn uniformly from
[min_len, max_len] with a fixed seed. Per round: create a partition, the writer puts every column of every
row in one put (write), the R readers, released together, each get their contiguous shard and touch
every byte (read: the slowest reader's get + touch, timed in its process), then the partition is dropped.
End-to-end is write + read of the same round. Round 0 is cold (new store, new pages, processes that have
not read yet): `cold`; after a warm-up round, the median of the rest is the steady state: `e2e_gbps`.

References measured in the same run on the same bytes:
- memcpy: copy the batch's buffers into pre-faulted memory, then touch every byte (the steady ceiling);
- fresh pages: the same into a new tmpfs file's pages, allocated by the copy (the cold ceiling);
- shm floor: this harness's processes and hand-offs doing only the work no checksummed shm store can
  skip (the writer copies and checksums each buffer into a pre-touched shared mapping, each reader
  checksums and touches its share): what is left between a store and it is the store's own cost;
- raw Mooncake: batch_put_from / batch_get_into of the same bytes with registered buffers.
Workers are started once and reused across repeats, so process start-up is not timed.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import sys
import time
from typing import Any

import numpy as np

from dataplane_rl.bench.store_refs import (
    fresh_page_ceiling,
    memcpy_ceiling,
    raw_mooncake,
    shm_floor,
)
from dataplane_rl.bench.store_report import plot, table
from dataplane_rl.bench.store_work import (
    _stats,
    bench_fields,
    bench_schema,
    make_batch,
    payload_bytes,
    touch,
    views_of,
)

DEFAULT_BACKENDS = "shm,mooncake,ray"
__all__ = ["fresh_page_ceiling", "make_batch", "memcpy_ceiling", "payload_bytes", "plot", "raw_mooncake", "run",
           "table", "touch", "views_of"]


# ---- workload --------------------------------------------------------------------------------------
def _writer(url: str, conn, samples: int, min_len: int, max_len: int, topk: int = 0) -> None:
    from dataplane_rl.store import open_store

    store = open_store(url)
    batch = make_batch(samples, min_len, max_len, topk=topk)
    conn.send("ready")
    while (msg := conn.recv()) is not None:
        store.create_partition(msg, bench_schema(topk), samples)
        t0 = time.perf_counter()
        store.put(msg, batch, range(samples))
        conn.send(time.perf_counter() - t0)
    store.close()


def _reader(url: str, conn, barrier, rows: tuple[int, int], topk: int = 0) -> None:
    """Gets on request: ("shard", pid) its shard, released with the other readers by the barrier;
    ("rows", pid, lo, hi) rows lo..hi-1 at once. Replies (start, end, bytes touched)."""
    from dataplane_rl.store import open_store

    fields = bench_fields(topk)

    store = open_store(url)
    conn.send("ready")
    while (msg := conn.recv()) is not None:
        if msg[0] == "shard":
            barrier.wait()
            lo, hi = rows
        else:
            lo, hi = msg[2], msg[3]
        t0 = time.perf_counter()
        table = store.get(msg[1], fields, range(lo, hi))
        touched = touch(views_of(table))
        t1 = time.perf_counter()
        del table
        conn.send((t0, t1, touched))
    store.close()


def run_backend(url: str, store, samples: int, min_len: int, max_len: int, readers: int, repeats: int,
                nbytes: int, small_repeats: int = 20, small_rows: int = 64, full_puts: int = 200,
                topk: int = 0) -> dict[str, Any]:
    """Rounds of what an RL step does with the store: create a partition, put the batch (writer process),
    get it by `readers` processes (each its shard, touched), drop it. Round 0 is cold (a new store, new
    processes, new pages); round 1 warms; the steady figures are the medians of rounds 2..repeats+1.
    Then the small calls, with reader 0 as the other process."""
    ctx = mp.get_context("spawn")
    w_parent, w_child = ctx.Pipe()
    barrier = ctx.Barrier(readers)
    procs = [ctx.Process(target=_writer, args=(url, w_child, samples, min_len, max_len, topk), daemon=True)]
    bounds = np.linspace(0, samples, readers + 1).astype(int)
    r_pipes = []
    for i in range(readers):
        parent, child = ctx.Pipe()
        r_pipes.append(parent)
        procs.append(ctx.Process(target=_reader, args=(url, child, barrier, (int(bounds[i]), int(bounds[i + 1])),
                                                       topk), daemon=True))
    for p in procs:
        p.start()
    try:
        for c in [w_parent, *r_pipes]:
            if _recv(c, procs, 120) != "ready":
                raise RuntimeError("a benchmark worker failed to start")
        rounds, skews = [], []  # (write s, read s); how far apart the readers started
        for k in range(repeats + 2):
            pid = f"bench-{k:04d}"
            w_parent.send(pid)
            w = _recv(w_parent, procs)
            for c in r_pipes:
                c.send(("shard", pid))
            res = [_recv(c, procs) for c in r_pipes]
            # the read: the slowest reader's get and touch, timed in its own process. Released together by
            # a barrier, the readers still wake up to ~1 ms apart on 2 cores: that is the benchmark's
            # signalling, not the store, and is reported apart (skew)
            r = max(t1 - t0 for t0, t1, _ in res)
            skews.append(max(t0 for t0, _, _ in res) - min(t0 for t0, _, _ in res))
            if sum(n for *_, n in res) < nbytes:  # (each shard's offsets also hold one entry more)
                raise RuntimeError(f"readers touched {sum(n for *_, n in res)} bytes of {nbytes}")
            store.drop_partition(pid)
            rounds.append((w, r))
        small = small_calls(store, min_len, max_len, small_repeats, r_pipes[0], procs, small_rows, full_puts, topk)
    finally:
        for c in [w_parent, *r_pipes]:
            try:
                c.send(None)
            except OSError:
                pass
        for p in procs:
            p.join(timeout=30)
            if p.is_alive():
                p.kill()
    steady = rounds[2:]
    cw, cr = rounds[0]  # the cold round
    return {"write_gbps": _stats([nbytes / w / 1e9 for w, _ in steady]),
            "read_gbps": _stats([nbytes / r / 1e9 for _, r in steady]),
            "e2e_gbps": _stats([nbytes / (w + r) / 1e9 for w, r in steady]),
            "cold": {"write_s": cw, "read_s": cr, "e2e_gbps": nbytes / (cw + cr) / 1e9},
            "rounds_e2e_gbps": [nbytes / (w + r) / 1e9 for w, r in rounds],
            "reader_start_skew_ms": _stats([x * 1e3 for x in skews[2:]]),
            "small": small}


def _recv(conn, procs, timeout: float = 300):
    """The next message from a worker, or an error if none comes in `timeout` s or a worker died."""
    deadline = time.monotonic() + timeout
    while not conn.poll(0.2):
        dead = [p for p in procs if not p.is_alive()]
        if dead:
            raise RuntimeError(f"benchmark worker {dead[0].name} exited with {dead[0].exitcode}")
        if time.monotonic() > deadline:
            raise RuntimeError(f"no answer from a benchmark worker in {timeout:g} s")
    return conn.recv()


def small_calls(store, min_len: int, max_len: int, repeats: int, reader=None, procs=(), rows: int = 64,
                full_puts: int = 200, topk: int = 0) -> dict[str, Any]:
    """µs per put and per get of `rows` rows (a GRPO step of 8 groups of 8) of DP_TRAIN_FIELDS: the fixed
    cost per call that the streaming trainer's many small puts and reads pay.
    - put, get: into a fresh partition and back, in this process;
    - remote_get: the same rows read by another process (`reader`), which first sees the partition then;
    - put_full, remote_get_full: a put into a partition already holding `full_puts` puts, and its rows
      read by the other process."""
    batch, schema, fields = make_batch(rows, min_len, max_len, seed=1, topk=topk), bench_schema(topk), bench_fields(topk)
    puts, gets, remote = [], [], []
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
        if reader is not None:
            reader.send(("rows", pid, 0, rows))
            r0, r1, _ = _recv(reader, procs)
        store.drop_partition(pid)
        if k:
            puts.append((t1 - t0) * 1e6)
            gets.append((t2 - t1) * 1e6)
            if reader is not None:
                remote.append((r1 - r0) * 1e6)
    out = {"rows": rows, "bytes": payload_bytes(batch), "put_us": _stats(puts), "get_us": _stats(gets)}
    if reader is not None:
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
                if reader is not None:
                    reader.send(("rows", pid, lo, lo + rows))
                    r0, r1, _ = _recv(reader, procs)
                if k >= full_puts:
                    full.append((t1 - t0) * 1e6)
                    if reader is not None:
                        full_remote.append((r1 - r0) * 1e6)
        finally:
            store.drop_partition(pid)
        suffix = "" if step else "_first_step"
        out[f"put_full{suffix}_us"] = _stats(full)
        if reader is not None:
            out[f"remote_get_full{suffix}_us"] = _stats(full_remote)
    out["full_puts"] = full_puts
    return out


def open_for_bench(name: str, mooncake_segment_mb: int):
    from dataplane_rl.store import open_store

    if name == "mooncake":
        from dataplane_rl.config import MooncakeConfig

        return open_store("mooncake://", config=MooncakeConfig(global_segment_size_mb=mooncake_segment_mb,
                                                               local_buffer_size_mb=max(128, mooncake_segment_mb // 2)))
    return open_store({"shm": "shm://", "ray": "ray://", "memory": "memory://"}[name])


def run(backends: list[str], samples: int, min_len: int, max_len: int, readers: int, repeats: int,
        log=print, small_repeats: int = 20, topk: int = 0) -> dict[str, Any]:
    batch = make_batch(samples, min_len, max_len, topk=topk)
    nbytes = payload_bytes(batch)
    # mooncake holds a put and its warm-up copy: size the segment from the batch (plus slack), and room
    # for the small calls' partition of 200+ puts
    small_bytes = payload_bytes(make_batch(64, min_len, max_len, seed=1, topk=topk)) * (200 + max(small_repeats, 1))
    seg_mb = max(256, int(nbytes * 4 / 2**20) + 64, int(small_bytes * 1.5 / 2**20) + 64)
    tokens = int(batch["input_lengths"].to_numpy().sum())
    log(f"[bench] {samples} samples, lengths {min_len}-{max_len}, {nbytes / 1e6:.2f} MB ({nbytes / tokens:.0f} B/token"
        f"{f', teacher top-{topk}' if topk else ''}), {readers} readers, 1 cold + 1 warm-up + {repeats} steady rounds")
    results: dict[str, Any] = {"workload": {"samples": samples, "min_len": min_len, "max_len": max_len,
                                            "readers": readers, "repeats": repeats, "bytes": nbytes, "topk": topk,
                                            "bytes_per_token": nbytes / tokens}}
    results["memcpy"] = memcpy_ceiling(batch, repeats)
    results["fresh_pages"] = fresh_page_ceiling(batch, max(repeats, 3))
    if "shm" in backends:
        results["shm_floor"] = shm_floor(samples, min_len, max_len, readers, repeats, nbytes, _recv, topk)
    log(f"[bench] memcpy ceiling e2e {results['memcpy']['e2e_gbps']['median']:.2f} GB/s, fresh tmpfs pages "
        f"{results['fresh_pages']['e2e_gbps']['median']:.2f} GB/s" +
        (f", shm floor {results['shm_floor']['e2e_gbps']['median']:.2f} GB/s" if "shm_floor" in results else ""))
    for name in backends:
        if name == "memory":
            log("[bench] memory:// is in-process only; it has no cross-process readers to measure")
            continue
        log(f"[bench] {name} ...")
        store = open_for_bench(name, seg_mb)
        try:
            results[name] = run_backend(store.url, store, samples, min_len, max_len, readers, repeats, nbytes,
                                        small_repeats=max(small_repeats, 1), topk=topk)
            if name == "mooncake":
                results["raw_mooncake"] = raw_mooncake(batch, readers, repeats, store.cluster)
        finally:
            store.close()
        log(f"[bench] {name} e2e {results[name]['e2e_gbps']['median']:.3f} GB/s steady, "
            f"{results[name]['cold']['e2e_gbps']:.3f} GB/s cold")
    ceiling = results["memcpy"]["e2e_gbps"]["median"]
    fresh = results["fresh_pages"]["e2e_gbps"]["median"]
    raw = results.get("raw_mooncake", {}).get("e2e_gbps", {}).get("median")
    floor = results.get("shm_floor", {}).get("e2e_gbps", {}).get("median")
    for name in backends:
        if name in results:
            results[name]["ratio_to_memcpy"] = results[name]["e2e_gbps"]["median"] / ceiling
            if floor:
                results[name]["ratio_to_shm_floor"] = results[name]["e2e_gbps"]["median"] / floor
            results[name]["cold"]["ratio_to_fresh_pages"] = results[name]["cold"]["e2e_gbps"] / fresh
            if raw:
                results[name]["ratio_to_raw_mooncake"] = results[name]["e2e_gbps"]["median"] / raw
    return results


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--backends", default=DEFAULT_BACKENDS, help=f"comma list of shm, mooncake, ray (default {DEFAULT_BACKENDS})")
    p.add_argument("--samples", type=int, default=512, help="rows in the batch (default %(default)s)")
    p.add_argument("--min-len", type=int, default=256, help="shortest row in tokens; lengths are drawn uniformly "
                   "from [min-len, max-len] with a fixed seed (default %(default)s)")
    p.add_argument("--max-len", type=int, default=1024, help="longest row in tokens (default %(default)s)")
    p.add_argument("--readers", type=int, default=2, help="reader processes, each getting a contiguous shard of "
                   "the rows (default %(default)s)")
    p.add_argument("--repeats", type=int, default=10, help="steady rounds of create, put, get and drop, timed "
                   "after a cold round and a warm-up round; their median is reported (default %(default)s)")
    p.add_argument("--small-repeats", type=int, default=20, help="timed calls of each small-call kind "
                   "(default %(default)s)")
    p.add_argument("--topk", type=int, default=0, help="add a teacher's top-k columns to the workload: "
                   "teacher_topk_logprobs (float32) and teacher_topk_ids (int32), [L, K] per row, 8*K bytes per token "
                   "(on-policy distillation; 0: none) (default %(default)s)")
    p.add_argument("--json", help="write results as JSON here")
    p.add_argument("--plot", help="write a bar chart PNG here")


def run_args(args) -> int:
    backends = [b for b in args.backends.split(",") if b]
    for b in backends:
        if b not in ("shm", "mooncake", "ray", "memory"):
            print(f"error: unknown backend '{b}'; use shm, mooncake, ray", file=sys.stderr)
            return 2
    for flag in ("samples", "min_len", "max_len", "readers", "repeats", "small_repeats"):
        if getattr(args, flag) < 1:
            print(f"error: --{flag.replace('_', '-')} {getattr(args, flag)}: must be at least 1", file=sys.stderr)
            return 2
    if args.topk < 0:
        print(f"error: --topk {args.topk}: must be 0 (no teacher columns) or more", file=sys.stderr)
        return 2
    if args.min_len > args.max_len:
        print(f"error: --min-len {args.min_len} is above --max-len {args.max_len}; swap them", file=sys.stderr)
        return 2
    res = run(backends, args.samples, args.min_len, args.max_len, args.readers, args.repeats,
              log=lambda s: print(s, file=sys.stderr, flush=True), small_repeats=args.small_repeats, topk=args.topk)
    print(table(res))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(res, f, indent=2)
    if args.plot:
        plot(res, args.plot)
    return 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="store_throughput", description=__doc__.splitlines()[0])
    add_arguments(p)
    return run_args(p.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
