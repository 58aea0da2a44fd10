"""Column-store throughput in the pattern of an RL step: N writer processes put GRPO groups into one
partition, M reader processes get rank shards, a new partition every round.

The batch holds DP_TRAIN_FIELDS with their declared dtypes (`--topk K`: and a teacher's top-k log-probs and
ids, [L, K] per row, the heaviest columns a distillation step moves); row lengths are drawn uniformly from
[min_len, max_len] with a fixed seed. Per round: create a partition; the N writers, released together,
each put their groups (`--group-size` rows each, groups w, w+N, w+2N, ... as a run's rollout actors
finish theirs; write: the slowest writer's puts, timed in its process); the M readers, released together,
each get their contiguous shard and touch every byte (read: the slowest reader's get + touch); then the
partition is dropped. End-to-end is write + read of the same round. Round 0 is cold (new store, new
pages, processes that have not read yet): `cold`; after a warm-up round, the median of the rest is the
steady state: `e2e_gbps`.

References in the same run, on the same bytes with the same N writers, M readers and groups:
- memcpy: the writers copy their groups into a pre-faulted shared mapping, the readers touch their
  shards' pieces (the steady ceiling);
- shm floor: the same, with the writers checksumming each piece they copy and the readers each piece
  they read: only the work no checksummed shm store can skip;
- fresh pages (in one process): the batch copied into a new tmpfs file's pages, then touched (the cold
  ceiling);
- raw Mooncake: one batch_put_from per group by the same writers, one batch_get_into per shard; and the
  Mooncake floor: the same, with the writers copying and checksumming each piece and the readers checksumming.
The fit (store_fit.py) runs the same rounds at several rows per call; every process's exit status and
peak memory is reported, and a reader holding more than its shard is flagged.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from typing import Any

from dataplane_rl.bench.store_args import add_arguments, checked
from dataplane_rl.bench.store_fit import fit_all, observations, targets
from dataplane_rl.bench.store_procs import Pool, WorkerFailed, serve
from dataplane_rl.bench.store_refs import fresh_page_ceiling, raw_mooncake, ref_pool
from dataplane_rl.bench.store_report import plot, print_profiles, table
from dataplane_rl.bench.store_small import small_calls
from dataplane_rl.bench.store_work import (
    Workload,
    _stats,
    bench_fields,
    bench_schema,
    make_batch,
    make_groups,
    payload_bytes,
    touch,
    views_of,
    writer_groups,
)
from dataplane_rl.errors import ConfigError

RETRIES = "dataplane_store_retries_total"
__all__ = ["Workload", "add_arguments", "fresh_page_ceiling", "make_batch", "payload_bytes", "plot", "raw_mooncake", "run",
           "table", "touch", "views_of"]


# ---- the store's workers ---------------------------------------------------------------------------
def _writer(conn, barrier, url: str, w: int, work: Workload, profile: str) -> None:
    """Writer w: on ("prep", size) makes its groups of `size` rows; on ("put", pid, size) puts them, one
    put per group in row order, timing each."""
    from dataplane_rl.bench.store_work import memory

    def setup():
        from dataplane_rl.store import open_store

        store = open_store(url)
        mine: dict[int, list] = {}

        def prep(size: int) -> None:
            if size not in mine:
                mine.clear()  # one size at a time: a writer holds its share of the batch once
                ranges = writer_groups(work.groups(size), w, work.writers)
                groups = make_groups(work.samples, work.min_len, work.max_len, ranges, topk=work.topk)
                mine[size] = (list(zip(ranges, groups)), sum(payload_bytes(g) for g in groups))

        prep(work.group_size)

        def handle(msg) -> dict:
            if msg[0] == "prep":
                prep(msg[1])
                return {}
            _, pid, size = msg
            groups, nbytes = mine[size]
            busy = cpu = 0.0
            t0, c0 = time.perf_counter(), time.thread_time()
            for (lo, hi), cols in groups:
                a, c = time.perf_counter(), time.thread_time()
                store.put(pid, cols, range(lo, hi))
                busy += time.perf_counter() - a
                cpu += time.thread_time() - c
            return {"t0": t0, "t1": time.perf_counter(), "calls": len(groups), "bytes": nbytes, "busy": busy,
                    "cpu": cpu, "round_cpu": time.thread_time() - c0, "mem": memory(),
                    "retries": store.counters()[RETRIES]}

        return handle, store.close

    serve(conn, barrier, setup, profile)


def _reader(conn, barrier, url: str, rows: tuple[int, int], profile: str, topk: int = 0) -> None:
    """On ("get", pid, size): its shard, in gets of `size` rows (0: one get), then touches every byte;
    on ("rows", pid, lo, hi): rows lo..hi-1 in one get, alone. Replies the times, calls and bytes touched,
    and its memory while it still holds what it got."""
    from dataplane_rl.bench.store_work import memory

    def setup():
        from dataplane_rl.store import open_store

        fields = bench_fields(topk)
        store = open_store(url)
        # a get of a partition of its own first: the modules and caches a first get brings in (10-30 MB of
        # private memory) are in the start memory, so what a round adds is what it got
        warm = f"bench-warm-{os.getpid()}"
        store.create_partition(warm, bench_schema(topk), 2)
        store.put(warm, make_batch(2, 8, 16, seed=2, topk=topk), range(2))
        touch(views_of(store.get(warm, fields, range(2))))
        store.drop_partition(warm)

        def handle(msg) -> dict:
            if msg[0] == "prep":
                return {}
            lo, hi = (rows if msg[0] == "get" else msg[2:4])
            step = (msg[2] or hi - lo) if msg[0] == "get" else hi - lo
            tables, busy, cpu = [], 0.0, 0.0
            t0, c0 = time.perf_counter(), time.thread_time()
            for a in range(lo, hi, max(step, 1)):
                s, c = time.perf_counter(), time.thread_time()
                tables.append(store.get(msg[1], fields, range(a, min(hi, a + step))))
                busy += time.perf_counter() - s
                cpu += time.thread_time() - c
            touched = sum(touch(views_of(t)) for t in tables)
            t1 = time.perf_counter()
            return {"t0": t0, "t1": t1, "calls": len(tables), "bytes": touched, "busy": busy, "cpu": cpu,
                    "round_cpu": time.thread_time() - c0, "mem": memory(), "retries": store.counters()[RETRIES]}

        return handle, store.close

    serve(conn, barrier, setup, profile)


def store_pool(label: str, url: str, work: Workload) -> Pool:
    return Pool(label, _writer, [(url, w, work, work.profile_path(label, f"writer {w}")) for w in range(work.writers)],
                _reader, [(url, s, work.profile_path(label, f"reader {i}"), work.topk) for i, s in enumerate(work.shards())],
                private=label == "mooncake")


# ---- rounds ----------------------------------------------------------------------------------------
def run_rounds(pool: Pool, count: int, nbytes: int, put_size: int, get_size: int, begin=None, end=None) -> list[dict]:
    """`count` rounds: begin(k) gives the partition (made there), the writers put, the readers get, end(pid)."""
    rounds = []
    for k in range(count):
        pid = begin(k) if begin else f"round-{k}"
        ws = pool.ask_all(pool.writers, ("put", pid, put_size))
        rs = pool.ask_all(pool.readers, ("get", pid, get_size))
        if end:
            end(pid)
        if sum(r["bytes"] for r in rs) < nbytes:  # (each shard's offsets also hold one entry more)
            raise RuntimeError(f"{pool.label}: readers touched {sum(r['bytes'] for r in rs)} bytes of {nbytes}")
        # the slowest process's own time: released together by a barrier, processes still wake up to
        # ~1 ms apart on 2 cores; that is the benchmark's signalling, not the store, and reported apart (skew)
        rounds.append({"write_s": max(r["t1"] - r["t0"] for r in ws), "read_s": max(r["t1"] - r["t0"] for r in rs),
                       "skew_s": max(r["t0"] for r in rs) - min(r["t0"] for r in rs), "writers": ws, "readers": rs,
                       "put_size": put_size, "get_size": get_size})
    return rounds


def summary(rounds: list[dict], nbytes: int) -> dict[str, Any]:
    """Steady medians of rounds 2.. (0 is cold, 1 warms up) and the cold round."""
    steady, cold = rounds[2:], rounds[0]
    return {"write_gbps": _stats([nbytes / r["write_s"] / 1e9 for r in steady]),
            "read_gbps": _stats([nbytes / r["read_s"] / 1e9 for r in steady]),
            "e2e_gbps": _stats([nbytes / (r["write_s"] + r["read_s"]) / 1e9 for r in steady]),
            "cold": {"write_s": cold["write_s"], "read_s": cold["read_s"],
                     "e2e_gbps": nbytes / (cold["write_s"] + cold["read_s"]) / 1e9},
            "rounds_e2e_gbps": [nbytes / (r["write_s"] + r["read_s"]) / 1e9 for r in rounds],
            "reader_start_skew_ms": _stats([r["skew_s"] * 1e3 for r in steady]),
            # each process's own CPU a steady round (its thread's: what it costs, not what it waited), the mean
            # over the role's processes: a writer's puts, a reader's gets and touch (the references alike)
            "round_cpu_ms": {role: _stats([statistics.mean(p["round_cpu"] for p in r[role]) * 1e3 for r in steady])
                             for role in ("writers", "readers")}}


def retries(last_round: dict) -> int:
    """Transient backend answers the workers retried (`dataplane_store_retries_total`, each process's own
    count since it started) up to the end of this round."""
    return int(sum(r["retries"] for r in last_round["writers"] + last_round["readers"]))


def run_backend(label: str, store, work: Workload, nbytes: int) -> dict[str, Any]:
    """The workload's rounds on one backend (`store` makes and drops the partitions), then the fit's passes
    (one warm-up and `fit_repeats` rounds per size), then the small calls with reader 0 as the other process."""
    pool = store_pool(label, store.url, work)
    seq = iter(range(10**9))

    def begin(_k: int) -> str:
        pid = f"bench-{next(seq):05d}"
        store.create_partition(pid, bench_schema(work.topk), work.samples)
        return pid

    try:
        pool.ready()
        rounds = run_rounds(pool, work.repeats + 2, nbytes, work.group_size, 0, begin, store.drop_partition)
        out = summary(rounds, nbytes)
        out["retries"] = retries(rounds[-1])
        fit_rounds = []
        for rep in range(work.fit_repeats + 1):  # the sizes alternate, so a busy neighbour slows them alike
            for size in work.fit_sizes:
                pool.ask_all(pool.writers, ("prep", size))
                done = run_rounds(pool, 1, nbytes, size, size, begin, store.drop_partition)
                fit_rounds += done if rep else []  # pass 0 warms each size up
        if work.fit_sizes:
            out["fit"] = fit_all(observations(fit_rounds))
        if work.small_repeats:
            out["small"] = small_calls(store, work.min_len, work.max_len, work.small_repeats, pool, topk=work.topk)
    except BaseException:
        pool.abort()
        raise
    out["processes"] = pool.close()
    return out


def open_for_bench(name: str, mooncake_segment_mb: int):
    from dataplane_rl.store import open_store

    if name == "mooncake":
        from dataplane_rl.config import MooncakeConfig

        return open_store("mooncake://", config=MooncakeConfig(global_segment_size_mb=mooncake_segment_mb,
                                                               local_buffer_size_mb=max(128, mooncake_segment_mb // 2)))
    return open_store({"shm": "shm://", "ray": "ray://", "memory": "memory://"}[name])


def run(backends: list[str], work: Workload, log=print) -> dict[str, Any]:
    batch = make_batch(work.samples, work.min_len, work.max_len, topk=work.topk)
    nbytes = payload_bytes(batch)
    tokens = int(batch["input_lengths"].to_numpy().sum())
    # mooncake holds a round's puts and its warm-up copy: size the segment from the batch (plus slack), and
    # room for the small calls' partition of 200+ puts
    small_bytes = payload_bytes(make_batch(64, work.min_len, work.max_len, seed=1, topk=work.topk)) * (200 + max(work.small_repeats, 1))
    seg_mb = max(256, int(nbytes * 4 / 2**20) + 64, int(small_bytes * 1.5 / 2**20) + 64)
    log(f"[bench] {work.samples} samples, lengths {work.min_len}-{work.max_len}, {nbytes / 1e6:.2f} MB ({nbytes / tokens:.0f} B/token"
        f"{f', teacher top-{work.topk}' if work.topk else ''}), "
        f"{work.writers} writers putting groups of {work.group_size or 'all their'} rows, {work.readers} readers, "
        f"1 cold + 1 warm-up + {work.repeats} steady rounds; fit at {list(work.fit_sizes) or 'no'} rows per call")
    results: dict[str, Any] = {"workload": {"samples": work.samples, "min_len": work.min_len, "max_len": work.max_len,
                                            "writers": work.writers, "readers": work.readers,
                                            "group_size": work.group_size, "repeats": work.repeats,
                                            "fit_sizes": list(work.fit_sizes), "bytes": nbytes, "topk": work.topk,
                                            "bytes_per_token": nbytes / tokens}}
    results["fresh_pages"] = fresh_page_ceiling(batch, max(work.repeats, 3))
    refs = ["memcpy", *(["shm_floor"] if "shm" in backends else [])]
    for ref in refs:
        pool, remove = ref_pool(ref, work)
        try:
            pool.ready()
            results[ref] = summary(run_rounds(pool, work.repeats + 2, nbytes, work.group_size, 0), nbytes)
            del results[ref]["cold"]  # its mapping is pre-touched: no cold round to speak of
        except BaseException:
            pool.abort()
            raise
        finally:
            remove()
        results[ref]["processes"] = pool.close()
    log(f"[bench] memcpy ceiling e2e {results['memcpy']['e2e_gbps']['median']:.2f} GB/s, fresh tmpfs pages "
        f"{results['fresh_pages']['e2e_gbps']['median']:.2f} GB/s" +
        (f", shm floor {results['shm_floor']['e2e_gbps']['median']:.2f} GB/s (CPU a steady round, a writer "
         f"{results['shm_floor']['round_cpu_ms']['writers']['median']:.1f} ms, a reader "
         f"{results['shm_floor']['round_cpu_ms']['readers']['median']:.1f} ms)" if "shm_floor" in results else ""))
    for name in backends:
        if name == "memory":
            log("[bench] memory:// is in-process only; it has no cross-process readers to measure")
            continue
        log(f"[bench] {name} ...")
        store = open_for_bench(name, seg_mb)
        try:
            results[name] = run_backend(name, store, work, nbytes)
            if name == "mooncake":
                results["raw_mooncake"] = raw_mooncake(work, store.cluster)
                results["mooncake_floor"] = raw_mooncake(work, store.cluster, checksummed=True)
        finally:
            store.close()
        log(f"[bench] {name} e2e {results[name]['e2e_gbps']['median']:.3f} GB/s steady, "
            f"{results[name]['cold']['e2e_gbps']:.3f} GB/s cold; CPU a steady round, a writer "
            f"{results[name]['round_cpu_ms']['writers']['median']:.1f} ms, a reader "
            f"{results[name]['round_cpu_ms']['readers']['median']:.1f} ms; the workers retried {results[name]['retries']} "
            "transient answers in these rounds")
    add_ratios(results, backends)
    results["targets"] = targets(results)
    return results


def add_ratios(results: dict[str, Any], backends: list[str]) -> None:
    ceiling = results["memcpy"]["e2e_gbps"]["median"]
    fresh = results["fresh_pages"]["e2e_gbps"]["median"]
    refs = {ref: results[ref]["e2e_gbps"]["median"] for ref in ("shm_floor", "raw_mooncake", "mooncake_floor")
            if ref in results}
    for name in backends:
        if name in results:
            results[name]["ratio_to_memcpy"] = results[name]["e2e_gbps"]["median"] / ceiling
            results[name]["cold"]["ratio_to_fresh_pages"] = results[name]["cold"]["e2e_gbps"] / fresh
            for ref, gbps in refs.items():
                results[name][f"ratio_to_{ref}"] = results[name]["e2e_gbps"]["median"] / gbps


# ---- command line ----------------------------------------------------------------------------------
def run_args(args) -> int:
    try:
        backends, work = checked(args)  # every flag, before a process starts or a byte is made
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    profile = work.profile
    if profile:
        os.makedirs(profile, exist_ok=True)
    try:
        res = run(backends, work, log=lambda s: print(s, file=sys.stderr, flush=True))
    except WorkerFailed as e:  # one line naming the worker, its backend and the error: no traceback
        print(f"error: bench store: {e}", file=sys.stderr)
        return 1
    print(table(res))
    if profile:
        print_profiles(res, work)
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
