"""Column-store throughput in the pattern of an RL step: one writer process, R reader processes, a
GRPO-shaped batch, a new partition every round.

The batch holds DP_TRAIN_FIELDS with their declared dtypes; row lengths are drawn uniformly from
[min_len, max_len] with a fixed seed. Per round: create a partition, the writer puts every column of every
row in one put (write), the R readers, released together, each get their contiguous shard and touch
every byte (read: the slowest reader's get + touch, timed in its process), then the partition is dropped.
End-to-end is write + read of the same round. Round 0 is cold (new store, new pages, processes that have
not read yet): `cold`; after a warm-up round, the median of the rest is the steady state: `e2e_gbps`.

References measured in the same run on the same bytes:
- memcpy: copy the batch's buffers into pre-faulted memory, then touch every byte (the steady ceiling);
- fresh pages: the same into a new tmpfs file's pages, allocated by the copy (the cold ceiling);
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
    """Read every byte (an xor over 8-byte words where aligned, the rest byte-wise); returns bytes read.
    A few numpy calls per array: the per-array cost counts against whoever hands out more pieces."""
    n = 0
    xor = np.bitwise_xor.reduce
    for arr in arrays:
        a = arr.view(np.uint8) if arr.ndim == 1 and arr.flags.c_contiguous else \
            np.ascontiguousarray(arr).reshape(-1).view(np.uint8)
        size = a.size
        n += size
        head = size & ~7 if a.ctypes.data & 7 == 0 else 0
        if head:
            xor(a[:head].view(np.uint64))
        if head < size:
            xor(a[head:])
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
    """Gets on request: ("shard", pid) its shard, released with the other readers by the barrier;
    ("rows", pid, lo, hi) rows lo..hi-1 at once. Replies (start, end, bytes touched)."""
    from dataplane_rl.schema import DP_TRAIN_FIELDS
    from dataplane_rl.store import open_store

    store = open_store(url)
    conn.send("ready")
    while (msg := conn.recv()) is not None:
        if msg[0] == "shard":
            barrier.wait()
            lo, hi = rows
        else:
            lo, hi = msg[2], msg[3]
        t0 = time.perf_counter()
        table = store.get(msg[1], DP_TRAIN_FIELDS, range(lo, hi))
        touched = touch(views_of(table))
        t1 = time.perf_counter()
        del table
        conn.send((t0, t1, touched))
    store.close()


def run_backend(url: str, store, samples: int, min_len: int, max_len: int, readers: int, repeats: int,
                nbytes: int, small_repeats: int = 20, small_rows: int = 64, full_puts: int = 200) -> dict[str, Any]:
    """Rounds of what an RL step does with the store: create a partition, put the batch (writer process),
    get it by `readers` processes (each its shard, touched), drop it. Round 0 is cold (a new store, new
    processes, new pages); round 1 warms; the steady figures are the medians of rounds 2..repeats+1.
    Then the small calls, with reader 0 as the other process."""
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
        small = small_calls(store, min_len, max_len, small_repeats, r_pipes[0], procs, small_rows, full_puts)
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
                full_puts: int = 200) -> dict[str, Any]:
    """µs per put and per get of `rows` rows (a GRPO step of 8 groups of 8) of DP_TRAIN_FIELDS: the fixed
    cost per call that the streaming trainer's many small puts and reads pay.
    - put, get: into a fresh partition and back, in this process;
    - remote_get: the same rows read by another process (`reader`), which first sees the partition then;
    - put_full, remote_get_full: a put into a partition already holding `full_puts` puts, and its rows
      read by the other process."""
    from dataplane_rl.schema import DP_TRAIN_FIELDS

    batch = make_batch(rows, min_len, max_len, seed=1)
    puts, gets, remote = [], [], []
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
        store.create_partition(pid, "grpo", rows * (full_puts + repeats))
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


def fresh_page_ceiling(batch: dict[str, pa.Array], repeats: int, folder: str = "/dev/shm") -> dict[str, Any]:
    """What a cold round cannot beat: copy the batch's buffers into a new tmpfs file's pages (each page
    allocated and faulted in by the copy), then touch every byte. A new file per repeat."""
    import mmap
    import os
    import uuid

    srcs = [v.view(np.uint8) for v in views_of(pa.table(batch)) if v.size]
    nbytes = sum(s.size for s in srcs)
    e2e = []
    for _ in range(repeats):
        path = os.path.join(folder, f".dataplane-rl-bench-{uuid.uuid4().hex}")
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            t0 = time.perf_counter()
            os.ftruncate(fd, nbytes)
            with mmap.mmap(fd, nbytes) as m:
                dst = np.frombuffer(m, dtype=np.uint8)
                parts, at = [], 0
                for s in srcs:
                    np.copyto(dst[at:at + s.size], s)
                    parts.append(dst[at:at + s.size])
                    at += s.size
                t1 = time.perf_counter()
                touch(parts)
                t2 = time.perf_counter()
                del dst, parts
            e2e.append(nbytes / (t2 - t0) / 1e9)
        finally:
            os.close(fd)
            os.unlink(path)
    return {"e2e_gbps": _stats(e2e)}


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
        log=print, small_repeats: int = 20) -> dict[str, Any]:
    batch = make_batch(samples, min_len, max_len)
    nbytes = payload_bytes(batch)
    # mooncake holds a put and its warm-up copy: size the segment from the batch (plus slack), and room
    # for the small calls' partition of 200+ puts
    small_bytes = payload_bytes(make_batch(64, min_len, max_len, seed=1)) * (200 + max(small_repeats, 1))
    seg_mb = max(256, int(nbytes * 4 / 2**20) + 64, int(small_bytes * 1.5 / 2**20) + 64)
    log(f"[bench] {samples} samples, lengths {min_len}-{max_len}, {nbytes / 1e6:.2f} MB, {readers} readers, "
        f"1 cold + 1 warm-up + {repeats} steady rounds")
    results: dict[str, Any] = {"workload": {"samples": samples, "min_len": min_len, "max_len": max_len,
                                            "readers": readers, "repeats": repeats, "bytes": nbytes}}
    results["memcpy"] = memcpy_ceiling(batch, repeats)
    results["fresh_pages"] = fresh_page_ceiling(batch, max(repeats, 3))
    log(f"[bench] memcpy ceiling e2e {results['memcpy']['e2e_gbps']['median']:.2f} GB/s, fresh tmpfs pages "
        f"{results['fresh_pages']['e2e_gbps']['median']:.2f} GB/s")
    for name in backends:
        if name == "memory":
            log("[bench] memory:// is in-process only; it has no cross-process readers to measure")
            continue
        log(f"[bench] {name} ...")
        store = open_for_bench(name, seg_mb)
        try:
            results[name] = run_backend(store.url, store, samples, min_len, max_len, readers, repeats, nbytes,
                                        small_repeats=max(small_repeats, 1))
            if name == "mooncake":
                results["raw_mooncake"] = raw_mooncake(batch, readers, repeats, store.cluster)
        finally:
            store.close()
        log(f"[bench] {name} e2e {results[name]['e2e_gbps']['median']:.3f} GB/s steady, "
            f"{results[name]['cold']['e2e_gbps']:.3f} GB/s cold")
    ceiling = results["memcpy"]["e2e_gbps"]["median"]
    fresh = results["fresh_pages"]["e2e_gbps"]["median"]
    raw = results.get("raw_mooncake", {}).get("e2e_gbps", {}).get("median")
    for name in backends:
        if name in results:
            results[name]["ratio_to_memcpy"] = results[name]["e2e_gbps"]["median"] / ceiling
            results[name]["cold"]["ratio_to_fresh_pages"] = results[name]["cold"]["e2e_gbps"] / fresh
            if raw:
                results[name]["ratio_to_raw_mooncake"] = results[name]["e2e_gbps"]["median"] / raw
    return results


SMALL_COLUMNS = (("put_us", "put"), ("put_full_us", "put into 200"), ("get_us", "get"),
                 ("remote_get_us", "get, other process"), ("remote_get_full_us", "get of 200, other process"))


def table(results: dict[str, Any]) -> str:
    """Two markdown tables: throughput (steady and cold) and the small calls' µs."""
    mem, fresh = results["memcpy"]["e2e_gbps"]["median"], results["fresh_pages"]["e2e_gbps"]["median"]
    raw = results.get("raw_mooncake", {}).get("e2e_gbps", {}).get("median")
    rows = ["| backend | write GB/s | read GB/s | steady e2e GB/s (min-max) | x memcpy | x raw Mooncake | "
            "cold e2e GB/s | cold x fresh pages |",
            "| --- | --- | --- | --- | --- | --- | --- | --- |"]
    for name in ("memcpy", "fresh_pages", "raw_mooncake", "shm", "mooncake", "ray"):
        if name not in results:
            continue
        r = results[name]
        e = r["e2e_gbps"]
        w = f"{r['write_gbps']['median']:.3f}" if "write_gbps" in r else "-"
        rd = f"{r['read_gbps']['median']:.3f}" if "read_gbps" in r else "-"
        ratio_r = f"{e['median'] / raw:.2f}" if raw else "-"
        cold = r.get("cold")
        c = f"{cold['e2e_gbps']:.3f} | {cold['e2e_gbps'] / fresh:.2f}" if cold else "- | -"
        rows.append(f"| {name} | {w} | {rd} | {e['median']:.3f} ({e['min']:.3f}-{e['max']:.3f}) | "
                    f"{e['median'] / mem:.2f} | {ratio_r} | {c} |")
    small = [n for n in ("shm", "mooncake", "ray") if n in results and "small" in results[n]]
    if small:
        s0 = results[small[0]]["small"]
        rows += ["", f"µs per call of {s0['rows']} rows ({s0['bytes'] / 1e6:.2f} MB), median (min-max):", "",
                 "| backend | " + " | ".join(label for _, label in SMALL_COLUMNS) + " |",
                 "| --- |" + " --- |" * len(SMALL_COLUMNS)]
        for name in small:
            sm = results[name]["small"]
            cells = [f"{sm[k]['median']:.0f} ({sm[k]['min']:.0f}-{sm[k]['max']:.0f})" if k in sm else "-"
                     for k, _ in SMALL_COLUMNS]
            rows.append(f"| {name} | " + " | ".join(cells) + " |")
    return "\n".join(rows)


def plot(results: dict[str, Any], path: str, title: str = "") -> None:
    """One run's figures: steady and cold e2e GB/s per backend beside their references, and the small
    calls' µs."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import matplotlib.ticker  # noqa: F401 - matplotlib.ticker.ScalarFormatter below

    backends = [n for n in ("shm", "mooncake", "ray") if n in results]
    small = [n for n in backends if "small" in results[n]]
    fig, axes = plt.subplots(1, 2 if small else 1, figsize=(11 if small else 6, 4), squeeze=False)
    ax = axes[0][0]
    names = ["memcpy", "fresh_pages", *(["raw_mooncake"] if "raw_mooncake" in results else []), *backends]
    x = np.arange(len(names))
    steady = [results[n]["e2e_gbps"]["median"] if n != "fresh_pages" else np.nan for n in names]
    cold = [results[n]["cold"]["e2e_gbps"] if "cold" in results[n] else
            (results[n]["e2e_gbps"]["median"] if n == "fresh_pages" else np.nan) for n in names]
    for k, (vals, label, color) in enumerate(((steady, "steady (median)", "#2a7"), (cold, "cold (first round)", "#c73"))):
        ax.bar(x + (k - 0.5) * 0.4, vals, 0.4, label=label, color=color)
        for i, v in enumerate(vals):
            if v == v:
                ax.text(x[i] + (k - 0.5) * 0.4, v, f"{v:.2f}", ha="center", va="bottom", fontsize=7)
    ax.set_xticks(x, [n.replace("_", "\n") for n in names], fontsize=8)
    ax.set_yscale("log")
    ax.yaxis.set_major_formatter(matplotlib.ticker.ScalarFormatter())
    ax.set_ylabel("end-to-end GB/s (log)")
    w = results["workload"]
    ax.set_title(f"{w['samples']} samples, lengths {w['min_len']}-{w['max_len']}, {w['readers']} readers", fontsize=9)
    ax.legend(fontsize=8)
    if small:
        ax = axes[0][1]
        keys = [(k, label) for k, label in SMALL_COLUMNS if k in results[small[0]]["small"]]
        xs = np.arange(len(small))
        width = 0.8 / len(keys)
        for j, (key, label) in enumerate(keys):
            ax.bar(xs + (j - (len(keys) - 1) / 2) * width, [results[n]["small"][key]["median"] for n in small],
                   width, label=label)
        ax.axhline(300, color="#888", linestyle="--", linewidth=0.8)
        ax.set_xticks(xs, small)
        ax.set_yscale("log")
        ax.yaxis.set_major_formatter(matplotlib.ticker.ScalarFormatter())
        ax.set_ylabel("µs per call (median, log); dashed: 300 µs")
        ax.set_title(f"{results[small[0]]['small']['rows']}-row calls", fontsize=9)
        ax.legend(fontsize=7)
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
    p.add_argument("--repeats", type=int, default=10, help="steady rounds of create, put, get and drop, timed "
                   "after a cold round and a warm-up round; their median is reported (default %(default)s)")
    p.add_argument("--small-repeats", type=int, default=20, help="timed calls of each small-call kind "
                   "(default %(default)s)")
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
    if args.min_len > args.max_len:
        print(f"error: --min-len {args.min_len} is above --max-len {args.max_len}; swap them", file=sys.stderr)
        return 2
    res = run(backends, args.samples, args.min_len, args.max_len, args.readers, args.repeats,
              log=lambda s: print(s, file=sys.stderr, flush=True), small_repeats=args.small_repeats)
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
