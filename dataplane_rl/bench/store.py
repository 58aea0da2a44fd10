"""Column-store throughput: one writer process, R reader processes, a GRPO-shaped batch.

The batch holds DP_TRAIN_FIELDS with their declared dtypes; row lengths are drawn uniformly from
[min_len, max_len] with a fixed seed. Per repeat: the writer puts every column of every row in one put
(write), then the R readers, released together, each get their contiguous shard and touch every byte
(read, first start to last end). End-to-end is write + read of the same repeat.

References measured in the same run on the same bytes:
- memcpy: copy the batch's buffers into pre-faulted memory, then touch every byte (the ceiling);
- raw Mooncake: batch_put_from / batch_get_into of the same bytes with registered buffers.
Workers are started once and reused across repeats, so process start-up is not timed.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import statistics
import sys
import time
from typing import Any

import numpy as np
import pyarrow as pa

DEFAULT_BACKENDS = "shm,mooncake,ray"


# ---- workload --------------------------------------------------------------------------------------
def make_batch(samples: int, min_len: int, max_len: int, seed: int = 0) -> dict[str, pa.Array]:
    """DP_TRAIN_FIELDS for `samples` rows, as Arrow arrays of the declared types."""
    from dataplane_rl.schema import DP_TRAIN_FIELDS, GRPO_SCHEMA
    from dataplane_rl.store import list_array

    rng = np.random.default_rng(seed)
    lengths = rng.integers(min_len, max_len + 1, size=samples).astype(np.int32)
    total = int(lengths.sum())
    out: dict[str, pa.Array] = {}
    for name in DP_TRAIN_FIELDS:
        col = GRPO_SCHEMA.column(name)
        np_type = np.dtype(col.value_type.to_pandas_dtype())
        n = total if col.kind == "token" else samples
        if name == "input_lengths":
            values = lengths
        elif np.issubdtype(np_type, np.floating):
            values = rng.standard_normal(n).astype(np_type)
        else:
            values = rng.integers(0, 2 if np_type.itemsize == 1 else 50_000, size=n).astype(np_type)
        arr = pa.array(values, type=col.value_type)
        out[name] = list_array(values, lengths, col.value_type) if col.kind == "token" else arr
    return out


def payload_bytes(batch: dict[str, pa.Array]) -> int:
    return sum(a.nbytes for a in batch.values())


def views_of(obj) -> list[np.ndarray]:
    """Zero-copy numpy views of exactly the bytes a (possibly sliced) column holds for its rows."""
    if isinstance(obj, pa.Table):
        return [v for c in obj.columns for v in views_of(c)]
    if isinstance(obj, pa.ChunkedArray):
        return [v for c in obj.chunks for v in views_of(c)]
    if pa.types.is_list(obj.type):
        offsets = obj.offsets  # sliced to this array's rows
        o = offsets.to_numpy(zero_copy_only=True)
        return [o, *views_of(obj.values.slice(int(o[0]), int(o[-1] - o[0])))]
    return [obj.to_numpy(zero_copy_only=True)]


def touch(arrays) -> int:
    """Read every byte (an xor over 8-byte words where aligned, the rest byte-wise); returns bytes read."""
    n = 0
    for arr in arrays:
        a = np.ascontiguousarray(arr).reshape(-1).view(np.uint8)
        n += a.size
        head = a.size - a.size % 8 if a.ctypes.data % 8 == 0 else 0
        if head:
            np.bitwise_xor.reduce(a[:head].view(np.uint64))
        if head < a.size:
            np.bitwise_xor.reduce(a[head:])
    return n


def _stats(xs: list[float]) -> dict[str, float]:
    return {"median": statistics.median(xs), "min": min(xs), "max": max(xs)}


# ---- worker processes ------------------------------------------------------------------------------
def _writer(url: str, conn, samples: int, min_len: int, max_len: int) -> None:
    from dataplane_rl.store import open_store

    store = open_store(url)
    batch = make_batch(samples, min_len, max_len)
    conn.send("ready")
    while (msg := conn.recv()) is not None:
        store.create_partition(msg, "grpo", samples)
        t0 = time.perf_counter()
        store.put(msg, batch, range(samples))
        conn.send(time.perf_counter() - t0)
    store.close()


def _reader(url: str, conn, barrier, rows: tuple[int, int]) -> None:
    from dataplane_rl.schema import DP_TRAIN_FIELDS
    from dataplane_rl.store import open_store

    store = open_store(url)
    conn.send("ready")
    while (msg := conn.recv()) is not None:
        barrier.wait()
        t0 = time.perf_counter()
        table = store.get(msg, DP_TRAIN_FIELDS, range(*rows))
        touched = touch(views_of(table))
        t1 = time.perf_counter()
        del table
        conn.send((t0, t1, touched))
    store.close()


def run_backend(url: str, store, samples: int, min_len: int, max_len: int, readers: int, repeats: int,
                nbytes: int) -> dict[str, Any]:
    ctx = mp.get_context("spawn")
    w_parent, w_child = ctx.Pipe()
    barrier = ctx.Barrier(readers)
    procs = [ctx.Process(target=_writer, args=(url, w_child, samples, min_len, max_len), daemon=True)]
    bounds = np.linspace(0, samples, readers + 1).astype(int)
    r_pipes = []
    for i in range(readers):
        parent, child = ctx.Pipe()
        r_pipes.append(parent)
        procs.append(ctx.Process(target=_reader, args=(url, child, barrier, (int(bounds[i]), int(bounds[i + 1]))),
                                 daemon=True))
    for p in procs:
        p.start()
    try:
        for c in [w_parent, *r_pipes]:
            if c.recv() != "ready":
                raise RuntimeError("worker failed to start")
        writes, reads = [], []
        for k in range(repeats + 1):  # repeat 0 warms up (page faults, connections, caches)
            pid = f"bench-{k:04d}"
            w_parent.send(pid)
            w = w_parent.recv()
            for c in r_pipes:
                c.send(pid)
            res = [c.recv() for c in r_pipes]
            r = max(t1 for _, t1, _ in res) - min(t0 for t0, _, _ in res)
            assert sum(n for *_, n in res) > 0
            store.drop_partition(pid)
            if k:
                writes.append(w)
                reads.append(r)
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
    e2e = [nbytes / (w + r) / 1e9 for w, r in zip(writes, reads)]
    return {"write_gbps": _stats([nbytes / w / 1e9 for w in writes]),
            "read_gbps": _stats([nbytes / r / 1e9 for r in reads]),
            "e2e_gbps": _stats(e2e)}


def small_calls(store, min_len: int, max_len: int, repeats: int, rows: int = 64) -> dict[str, Any]:
    """µs per put and per get of `rows` rows (a GRPO step of 8 groups of 8) of DP_TRAIN_FIELDS, in this
    process: the fixed cost per call that the streaming trainer's many small puts and reads pay."""
    from dataplane_rl.schema import DP_TRAIN_FIELDS

    batch = make_batch(rows, min_len, max_len, seed=1)
    puts, gets = [], []
    for k in range(repeats + 1):  # call 0 warms up
        pid = f"bench-small-{k:04d}"
        store.create_partition(pid, "grpo", rows)
        t0 = time.perf_counter()
        store.put(pid, batch, range(rows))
        t1 = time.perf_counter()
        table = store.get(pid, DP_TRAIN_FIELDS, range(rows))
        t2 = time.perf_counter()
        assert table.num_rows == rows
        del table
        store.drop_partition(pid)
        if k:
            puts.append((t1 - t0) * 1e6)
            gets.append((t2 - t1) * 1e6)
    return {"rows": rows, "bytes": payload_bytes(batch), "put_us": _stats(puts), "get_us": _stats(gets)}


def memcpy_ceiling(batch: dict[str, pa.Array], repeats: int) -> dict[str, Any]:
    """Copy the batch's buffers into pre-faulted memory, then touch every byte of the copy."""
    srcs = [v.view(np.uint8) for v in views_of(pa.table(batch))]
    dst = [np.ones(s.size, dtype=np.uint8) for s in srcs]  # ones(): pre-faulted
    nbytes = sum(s.size for s in srcs)
    writes, reads = [], []
    for k in range(repeats + 1):
        t0 = time.perf_counter()
        for s, d in zip(srcs, dst):
            np.copyto(d, s)
        t1 = time.perf_counter()
        touch(dst)  # the readers' work
        t2 = time.perf_counter()
        if k:
            writes.append(t1 - t0)
            reads.append(t2 - t1)
    return {"write_gbps": _stats([nbytes / w / 1e9 for w in writes]),
            "read_gbps": _stats([nbytes / r / 1e9 for r in reads]),
            "e2e_gbps": _stats([nbytes / (w + r) / 1e9 for w, r in zip(writes, reads)])}


def raw_mooncake(batch: dict[str, pa.Array], readers: int, repeats: int, cluster) -> dict[str, Any]:
    """Raw Mooncake batch_put_from / batch_get_into of the same bytes (one key per buffer)."""
    from dataplane_rl.bench.raw_mooncake import raw_mooncake_roundtrip

    bufs = [v.view(np.uint8) for v in views_of(pa.table(batch)) if v.size]
    res = raw_mooncake_roundtrip(cluster, bufs, repeats=repeats, readers=readers)
    return {k: res[k] for k in ("write_gbps", "read_gbps", "e2e_gbps")}


def open_for_bench(name: str, mooncake_segment_mb: int):
    from dataplane_rl.store import open_store

    if name == "mooncake":
        from dataplane_rl.config import MooncakeConfig

        return open_store("mooncake://", config=MooncakeConfig(global_segment_size_mb=mooncake_segment_mb,
                                                               local_buffer_size_mb=max(128, mooncake_segment_mb // 2)))
    return open_store({"shm": "shm://", "ray": "ray://", "memory": "memory://"}[name])


def run(backends: list[str], samples: int, min_len: int, max_len: int, readers: int, repeats: int,
        log=print) -> dict[str, Any]:
    batch = make_batch(samples, min_len, max_len)
    nbytes = payload_bytes(batch)
    # mooncake holds a put and its warm-up copy: size the segment from the batch (plus slack)
    seg_mb = max(256, int(nbytes * 4 / 2**20) + 64)
    log(f"[bench] {samples} samples, lengths {min_len}-{max_len}, {nbytes / 1e6:.2f} MB, {readers} readers, "
        f"{repeats} repeats")
    results: dict[str, Any] = {"workload": {"samples": samples, "min_len": min_len, "max_len": max_len,
                                            "readers": readers, "repeats": repeats, "bytes": nbytes}}
    results["memcpy"] = memcpy_ceiling(batch, repeats)
    log(f"[bench] memcpy ceiling e2e {results['memcpy']['e2e_gbps']['median']:.2f} GB/s")
    for name in backends:
        if name == "memory":
            log("[bench] memory:// is in-process only; it has no cross-process readers to measure")
            continue
        log(f"[bench] {name} ...")
        store = open_for_bench(name, seg_mb)
        try:
            results[name] = run_backend(store.url, store, samples, min_len, max_len, readers, repeats, nbytes)
            results[name]["small"] = small_calls(store, min_len, max_len, max(repeats, 20))
            if name == "mooncake":
                results["raw_mooncake"] = raw_mooncake(batch, readers, repeats, store.cluster)
        finally:
            store.close()
        log(f"[bench] {name} e2e {results[name]['e2e_gbps']['median']:.3f} GB/s")
    ceiling = results["memcpy"]["e2e_gbps"]["median"]
    raw = results.get("raw_mooncake", {}).get("e2e_gbps", {}).get("median")
    for name in backends:
        if name in results:
            results[name]["ratio_to_memcpy"] = results[name]["e2e_gbps"]["median"] / ceiling
            if raw:
                results[name]["ratio_to_raw_mooncake"] = results[name]["e2e_gbps"]["median"] / raw
    return results


def table(results: dict[str, Any]) -> str:
    rows = ["| backend | write GB/s | read GB/s | e2e GB/s (min-max) | x memcpy | x raw Mooncake | "
            "64-row put µs | 64-row get µs |",
            "| --- | --- | --- | --- | --- | --- | --- | --- |"]
    for name in ("memcpy", "raw_mooncake", "shm", "mooncake", "ray"):
        if name not in results:
            continue
        r = results[name]
        e = r["e2e_gbps"]
        ratio_m = r.get("ratio_to_memcpy", r["e2e_gbps"]["median"] / results["memcpy"]["e2e_gbps"]["median"])
        raw = results.get("raw_mooncake", {}).get("e2e_gbps", {}).get("median")
        ratio_r = f"{e['median'] / raw:.2f}" if raw else "-"
        small = r.get("small")
        lat = f"{small['put_us']['median']:.0f} | {small['get_us']['median']:.0f}" if small else "- | -"
        rows.append(f"| {name} | {r['write_gbps']['median']:.3f} | {r['read_gbps']['median']:.3f} | "
                    f"{e['median']:.3f} ({e['min']:.3f}-{e['max']:.3f}) | {ratio_m:.2f} | {ratio_r} | {lat} |")
    return "\n".join(rows)


def plot(results: dict[str, Any], path: str, title: str = "") -> None:
    """Bar charts of one run: e2e GB/s per backend and reference, and the 64-row put/get latency."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import matplotlib.ticker  # noqa: F401 - matplotlib.ticker.ScalarFormatter below

    names = [n for n in ("memcpy", "raw_mooncake", "shm", "mooncake", "ray") if n in results]
    small = [n for n in names if "small" in results[n]]
    fig, axes = plt.subplots(1, 2 if small else 1, figsize=(10 if small else 6, 3.8), squeeze=False)
    ax = axes[0][0]
    vals = [results[n]["e2e_gbps"]["median"] for n in names]
    ax.bar([n.replace("_", "\n") for n in names], vals,
           color=["#999" if n in ("memcpy", "raw_mooncake") else "#2a7" for n in names])
    for i, v in enumerate(vals):
        ax.text(i, v, f"{v:.2f}", ha="center", va="bottom", fontsize=8)
    ax.set_yscale("log")
    ax.yaxis.set_major_formatter(matplotlib.ticker.ScalarFormatter())
    ax.set_ylabel("end-to-end GB/s (median, log)")
    w = results["workload"]
    ax.set_title(f"{w['samples']} samples, lengths {w['min_len']}-{w['max_len']}, {w['readers']} readers", fontsize=9)
    if small:
        ax = axes[0][1]
        x = np.arange(len(small))
        for k, (key, color) in enumerate((("put_us", "#2a7"), ("get_us", "#27a"))):
            ax.bar(x + (k - 0.5) * 0.4, [results[n]["small"][key]["median"] for n in small], 0.4, color=color,
                   label=key.replace("_us", ""))
        ax.set_xticks(x, small)
        ax.set_yscale("log")
        ax.yaxis.set_major_formatter(matplotlib.ticker.ScalarFormatter())
        ax.set_ylabel("µs per call (median, log)")
        ax.set_title(f"{results[small[0]]['small']['rows']}-row put and get", fontsize=9)
        ax.legend(fontsize=8)
    if title:
        fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--backends", default=DEFAULT_BACKENDS, help=f"comma list of shm, mooncake, ray (default {DEFAULT_BACKENDS})")
    p.add_argument("--samples", type=int, default=512, help="rows in the batch (default %(default)s)")
    p.add_argument("--min-len", type=int, default=256, help="shortest row in tokens; lengths are drawn uniformly "
                   "from [min-len, max-len] with a fixed seed (default %(default)s)")
    p.add_argument("--max-len", type=int, default=1024, help="longest row in tokens (default %(default)s)")
    p.add_argument("--readers", type=int, default=2, help="reader processes, each getting a contiguous shard of "
                   "the rows (default %(default)s)")
    p.add_argument("--repeats", type=int, default=10, help="timed write+read rounds after one warm-up; the "
                   "median is reported (default %(default)s)")
    p.add_argument("--json", help="write results as JSON here")
    p.add_argument("--plot", help="write a bar chart PNG here")


def run_args(args) -> int:
    backends = [b for b in args.backends.split(",") if b]
    for b in backends:
        if b not in ("shm", "mooncake", "ray", "memory"):
            print(f"error: unknown backend '{b}'; use shm, mooncake, ray", file=sys.stderr)
            return 2
    for flag in ("samples", "min_len", "max_len", "readers", "repeats"):
        if getattr(args, flag) < 1:
            print(f"error: --{flag.replace('_', '-')} {getattr(args, flag)}: must be at least 1", file=sys.stderr)
            return 2
    if args.min_len > args.max_len:
        print(f"error: --min-len {args.min_len} is above --max-len {args.max_len}; swap them", file=sys.stderr)
        return 2
    res = run(backends, args.samples, args.min_len, args.max_len, args.readers, args.repeats,
              log=lambda s: print(s, file=sys.stderr, flush=True))
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
