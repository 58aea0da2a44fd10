"""Raw Mooncake throughput: the reference the column-store benchmark is compared against.

W writer processes put every buffer under its own key with `batch_put_from` (one call per group of
keys, from each writer's registered arena; groups dealt out as rollout actors finish theirs); then R
reader processes, started together, each read a contiguous shard with one `batch_get_into` (or
`get_into_ranges`) call into their own registered arena. No serialization, no
checksums, no catalog: just Mooncake's zero-copy batch calls.

    from dataplane_rl.bench.raw_mooncake import raw_mooncake_roundtrip
    res = raw_mooncake_roundtrip(cluster, buffers, repeats=10, readers=2)   # a MooncakeCluster or "HOST:PORT"
    res["read_gbps"]["median"]

Run standalone (starts its own cluster; the command line is raw_mooncake_main.py):

    python benchmarks/raw_mooncake.py --samples 512 --layout per-sample --layout per-column --readers 1 2
    python -m dataplane_rl.bench.raw_mooncake_main ...     # the same

GB/s are 1e9 bytes per second over the payload bytes. write: the slowest writer's batch_put_from calls.
read: the slowest reader's calls (readers are released at the same instant).
e2e: write + read of the same repeat (the data path of one put followed by the shard reads,
without the coordination between them).
"""

from __future__ import annotations

import contextlib
import multiprocessing as mp
import statistics
import time
import uuid
from typing import Any, Sequence

import numpy as np
import xxhash

# default synthetic sample: 9 columns, 11,128 bytes per sample (x512 = 5.70 MB)
DEFAULT_COLUMN_BYTES = (4096, 4096, 2048, 512, 256, 64, 32, 16, 8)


# ---- helpers -----------------------------------------------------------------------------------
def as_bytes_array(buf: Any) -> np.ndarray:
    """A 1-D uint8 view (or contiguous copy) of a memoryview, bytes-like or numpy array."""
    if isinstance(buf, np.ndarray):
        return np.ascontiguousarray(buf).reshape(-1).view(np.uint8)
    mv = memoryview(buf)
    if not mv.contiguous:
        mv = memoryview(mv.tobytes())
    return np.frombuffer(mv.cast("B"), dtype=np.uint8)


def _stats(xs: Sequence[float]) -> dict[str, float]:
    return {"median": float(statistics.median(xs)), "min": float(min(xs)), "max": float(max(xs))}


def _address_of(cluster_or_address: Any) -> tuple[str, str, str]:
    if isinstance(cluster_or_address, str):
        addr = cluster_or_address.split("://", 1)[-1]
        return addr, "tcp", ""
    c = cluster_or_address
    return c.master_address, getattr(c, "protocol", "tcp"), getattr(c, "device_name", "")


def _wait_until(t: float) -> None:
    while True:
        d = t - time.monotonic()
        if d <= 0:
            return
        if d > 0.002:
            time.sleep(d - 0.001)


def _codes(codes) -> str:
    from dataplane_rl.store.mooncake.client import error_name

    bad = sorted({c for c in codes if c < 0})
    return ", ".join(error_name(c) for c in bad)


# ---- worker processes --------------------------------------------------------------------------
def _chunks(n: int, per_call: int):
    for lo in range(0, n, per_call):
        yield lo, min(n, lo + per_call)


def _worker(role: str, conn, master: str, protocol: str, device: str, sizes: list[int],
            payload: np.ndarray | None, ranges: list[tuple[int, int, int]] | None, per_call: int,
            touching: bool = False, pieces: list | None = None) -> None:
    """role 'writer': holds its buffers back to back in `payload` and puts `ranges`, a list of calls (a group's
    [(key index, 0, size)]); role 'reader': reads `ranges` ((key index, byte lo, byte hi)), then, if
    `touching`, reads every byte it got (within its timed read, as `bench store`'s readers do).
    `pieces` (checksummed): a writer's, per call, [(arena offset, source buffer)] that it copies into its
    arena and checksums before the call; a reader's, [(arena offset, size)] that it checksums before its touch."""
    try:
        from dataplane_rl.bench.store_work import memory, touch
        from dataplane_rl.store.mooncake.client import connect_client, no_eviction_config

        t0 = time.monotonic()
        client = connect_client(master, 0, protocol=protocol, device_name=device)
        setup_s = time.monotonic() - t0
        if role == "writer":
            arena = payload
            nbytes = int(arena.nbytes)
        else:
            nbytes = int(sum(hi - lo for _, lo, hi in ranges)) or 1
            arena = np.ones(nbytes, dtype=np.uint8)  # pages touched before timing
        base = arena.ctypes.data
        rc = client.register_buffer(base, nbytes)
        if rc != 0:
            raise RuntimeError(f"register_buffer({nbytes} bytes) failed: {rc}")
        cfg = no_eviction_config()
        conn.send(("ready", setup_s, memory()))
        while True:
            msg = conn.recv()
            if msg[0] == "stop":
                break
            _, prefix, t_go = msg
            keys = [f"{prefix}/{i}" for i in range(len(sizes))]
            if msg[0] == "write":  # one batch_put_from per call (a group's keys), split at per_call keys
                calls, pos = [], 0
                for group in ranges:
                    calls.append(([keys[k] for k, _, _ in group], [base + pos + o for o in
                                  np.cumsum([0] + [hi for _, _, hi in group[:-1]]).tolist()], [hi for _, _, hi in group]))
                    pos += sum(hi for _, _, hi in group)
                _wait_until(t_go)
                s = time.monotonic()
                codes = []
                for i, (ks, ps, ns) in enumerate(calls):
                    for at, src in pieces[i] if pieces else ():  # a store's copy of the caller's buffers
                        part = arena[at:at + src.size]
                        np.copyto(part, src)
                        xxhash.xxh3_64_intdigest(part)
                    for lo, hi in _chunks(len(ks), per_call):
                        codes += client.batch_put_from(ks[lo:hi], ps[lo:hi], ns[lo:hi], cfg)
                e = time.monotonic()
                err = _codes(codes) if any(c != 0 for c in codes) else ""
                conn.send(("done", s, e, err))
            elif msg[0] == "read":
                whole = all(lo == 0 and hi == sizes[k] for k, lo, hi in ranges)
                _wait_until(t_go)
                rkeys = [keys[k] for k, _, _ in ranges]
                rsizes = [hi - lo for _, lo, hi in ranges]
                starts = np.cumsum([0] + rsizes[:-1]).tolist()  # each range's place in the arena, back to back
                if whole:  # contiguous run of whole keys: one batch_get_into
                    ptrs = [base + at for at in starts]
                    s = time.monotonic()
                    codes = []
                    for lo, hi in _chunks(len(rkeys), per_call):
                        codes += client.batch_get_into(rkeys[lo:hi], ptrs[lo:hi], rsizes[lo:hi])
                else:  # the same byte range of every key: one ranged get
                    dst, src, ln = [[at] for at in starts], [[lo] for _, lo, _ in ranges], [[n] for n in rsizes]
                    s = time.monotonic()
                    codes = []
                    for lo, hi in _chunks(len(rkeys), per_call):
                        out = client.get_into_ranges([base], [rkeys[lo:hi]], [dst[lo:hi]], [src[lo:hi]], [ln[lo:hi]])
                        codes += [x[0] for x in out[0]]
                for at, n in pieces or ():
                    xxhash.xxh3_64_intdigest(arena[at:at + n])
                if touching:
                    touch([arena])
                e = time.monotonic()
                bad = [c for c, n in zip(codes, rsizes) if c != n]
                err = (_codes(bad) or f"short reads {bad[:5]}") if bad else ""
                conn.send(("done", s, e, err, xxhash.xxh3_64_intdigest(arena)))
            elif msg[0] == "remove":
                codes = []
                mine = [keys[k] for group in ranges for k, _, _ in group]
                for lo, hi in _chunks(len(mine), per_call):
                    codes += client.batch_remove(mine[lo:hi], True)
                conn.send(("done", [c for c in codes if c != 0]))
        client.close()
        conn.send(("closed", memory()))
    except BaseException as e:  # report, don't hang the parent
        try:
            conn.send(("error", f"{role}: {type(e).__name__}: {e}"))
        except Exception:
            pass


def _shards(sizes: list[int], readers: int, shard: str, group_of: Sequence[int]) -> list[list[tuple[int, int, int]]]:
    n = len(sizes)
    if shard == "keys":  # whole groups of keys
        groups = max(group_of) + 1
        if readers > groups:
            raise ValueError(f"{readers} readers but only {groups} groups of keys; use shard='bytes'")
        return [[(k, 0, sizes[k]) for k in range(n) if r * groups // readers <= group_of[k] < (r + 1) * groups // readers]
                for r in range(readers)]
    if shard == "bytes":
        return [[(k, sizes[k] * r // readers, sizes[k] * (r + 1) // readers) for k in range(n)
                 if sizes[k] * (r + 1) // readers > sizes[k] * r // readers] for r in range(readers)]
    raise ValueError(f"shard must be 'keys' or 'bytes', got {shard!r}")


def _places(calls: list[list[np.ndarray]]) -> list[list[tuple[int, np.ndarray]]]:
    """Each call's buffers with their offsets, back to back across the calls (one arena)."""
    at, out = 0, []
    for bufs in calls:
        out.append([])
        for b in bufs:
            out[-1].append((at, b))
            at += b.nbytes
    return out


def _expected_digest(arrays: list[np.ndarray], ranges: list[tuple[int, int, int]]) -> int:
    parts = [arrays[k][lo:hi] for k, lo, hi in ranges]
    arr = np.concatenate(parts) if parts else np.zeros(0, np.uint8)
    if arr.nbytes == 0:
        arr = np.ones(1, np.uint8)  # a reader with nothing to read keeps its 1-byte arena of ones
    return xxhash.xxh3_64_intdigest(arr)


# ---- the measurement ---------------------------------------------------------------------------
def raw_mooncake_roundtrip(cluster_or_address: Any, buffers: Sequence[Any], repeats: int = 10, readers: int = 1, *,
                           writers: int = 1, group_of: Sequence[int] | None = None, shard: str = "keys",
                           warmup: int = 1, verify: bool = True, max_keys_per_call: int = 1024,
                           timeout: float = 300.0, touching: bool = False,
                           pieces: Sequence[Sequence[Any]] | None = None) -> dict[str, Any]:
    """Measure raw batch_put_from / batch_get_into GB/s for `writers` writer and `readers` reader processes.

    cluster_or_address: a started MooncakeCluster, or a master address 'HOST:PORT' / 'mooncake://HOST:PORT'
    (tcp). buffers: one object per key (memoryview, bytes-like or numpy array; read as raw bytes).
    group_of: each buffer's group (consecutive buffers of one group): writer w puts groups w, w + writers,
    ... each with one batch_put_from, as rollout actors put their groups (default: one writer call of all).
    shard: 'keys' - reader r reads the keys of groups [r*G/R, (r+1)*G/R) whole (one batch_get_into);
           'bytes' - reader r reads bytes [r/R, (r+1)/R) of every key (one get_into_ranges), i.e. a row
           shard of per-column chunks of fixed-width columns.
    max_keys_per_call: batch calls are split into calls of at most this many keys, run back to back
    (Mooncake's TCP transport wedges on batches of more than ~2000 small keys; see store/mooncake/client.py).
    Each repeat writes fresh keys and removes them afterwards (put of an existing key would be a no-op).
    write: the slowest writer's puts; read: the slowest reader's gets (each timed in its process), and with
    `touching` its read of every byte it got (what a consumer does, and `bench store`'s readers time).
    pieces (checksummed, shard 'keys' only): each key's buffers, whose bytes back to back are the key's. A
    writer then copies them into its arena and checksums each inside its timed put (as a store copies the
    caller's columns), and a reader checksums each piece it read before its touch: with the puts and gets
    themselves, the work no checksummed store on Mooncake can skip.
    Returns write/read/e2e GB/s stats (median, min, max over `repeats`), the per-repeat seconds, setup
    times, and every process's exit status and memory (`processes`).
    """
    from dataplane_rl.bench.store_procs import process_memory

    if repeats < 1 or readers < 1 or writers < 1:
        raise ValueError("repeats, readers and writers must be >= 1")
    master, protocol, device = _address_of(cluster_or_address)
    arrays = [as_bytes_array(b) for b in buffers]
    sizes = [int(a.nbytes) for a in arrays]
    if not sizes or min(sizes) <= 0:
        raise ValueError("need at least one buffer, and Mooncake refuses empty objects")
    if group_of is not None and len(group_of) != len(sizes):
        raise ValueError(f"group_of has {len(group_of)} entries for {len(sizes)} buffers")
    total = int(sum(sizes))
    # without groups: one writer call of every key, and readers shard by key
    shards = _shards(sizes, readers, shard, range(len(sizes)) if group_of is None else group_of)
    group_of = [0] * len(sizes) if group_of is None else [int(g) for g in group_of]
    calls: list[list[list[tuple[int, int, int]]]] = [[] for _ in range(writers)]  # per writer, per group
    for k, g in enumerate(group_of):
        mine = calls[g % writers]
        if not mine or group_of[mine[-1][-1][0]] != g:
            mine.append([])
        mine[-1].append((k, 0, sizes[k]))
    payloads = [np.concatenate([arrays[k] for group in mine for k, _, _ in group]) if mine else np.ones(1, np.uint8)
                for mine in calls]
    expected = [_expected_digest(arrays, s) for s in shards] if verify else None
    wpieces, rpieces = [None] * writers, [None] * readers
    if pieces is not None:
        if shard != "keys" or len(pieces) != len(sizes):
            raise ValueError("pieces: one list of buffers per key, with shard='keys'")
        srcs = [[as_bytes_array(b) for b in bs] for bs in pieces]
        if [sum(b.nbytes for b in bs) for bs in srcs] != sizes:
            raise ValueError("pieces: a key's buffers must hold exactly its bytes")
        wpieces = [_places([[b for k, _, _ in group for b in srcs[k]] for group in mine]) for mine in calls]
        rpieces = [[(at, b.nbytes) for at, b in _places([[b for k, _, _ in s for b in srcs[k]]])[0]]
                   for s in shards]

    ctx = mp.get_context("spawn")  # a Mooncake client must not be forked
    procs, conns, roles = [], [], []

    def start(role, data, ranges, places):
        parent, child = ctx.Pipe()
        p = ctx.Process(target=_worker, args=(role, child, master, protocol, device, sizes, data, ranges,
                                              max_keys_per_call, touching, places), daemon=True)
        p.start()
        procs.append(p)
        conns.append(parent)
        roles.append(f"{role} {sum(r.startswith(role) for r in roles)}")
        return parent

    def recv(conn):
        if not conn.poll(timeout):
            raise TimeoutError(f"raw_mooncake worker did not answer within {timeout}s")
        msg = conn.recv()
        if msg[0] == "error":
            raise RuntimeError(f"raw_mooncake worker failed: {msg[1]}")
        return msg

    write_s, read_s, per_reader, setups, mem0, mem1 = [], [], [], {}, [], []
    prefix_base = f"raw-mooncake-{uuid.uuid4().hex[:12]}"
    try:
        writer_conns = [start("writer", payload, mine, ps) for payload, mine, ps in zip(payloads, calls, wpieces)
                        if mine]
        reader_conns = [start("reader", None, s, ps) for s, ps in zip(shards, rpieces)]
        ready = [recv(c) for c in writer_conns + reader_conns]
        setups["writer_setup_s"] = [m[1] for m in ready[:len(writer_conns)]]
        setups["reader_setup_s"] = [m[1] for m in ready[len(writer_conns):]]
        mem0 = [m[2] for m in ready]
        del payloads
        for rep in range(warmup + repeats):
            prefix = f"{prefix_base}/{rep}"
            t_go = time.monotonic() + 0.005
            for c in writer_conns:
                c.send(("write", prefix, t_go))
            wres = [recv(c) for c in writer_conns]
            errs = [err for _, _, _, err in wres if err]
            if errs:
                raise RuntimeError(f"batch_put_from failed for {total} bytes in {len(sizes)} keys: {errs[0]}")
            t_go = time.monotonic() + 0.02
            for c in reader_conns:
                c.send(("read", prefix, t_go))
            results = [recv(c) for c in reader_conns]
            for c in writer_conns:  # the repeat's keys go before any error is raised (pinned: nothing evicts them)
                c.send(("remove", prefix, 0.0))
            for c in writer_conns:
                recv(c)
            for r, (_, s, e, err, digest) in enumerate(results):
                if err:
                    raise RuntimeError(f"reader {r}: batch read failed: {err}")
                if verify and digest != expected[r]:
                    raise RuntimeError(f"reader {r} read different bytes than were written (repeat {rep})")
            if rep >= warmup:
                write_s.append(max(e - s for _, s, e, _ in wres))
                read_s.append(max(e - s for _, s, e, _, _ in results))  # the slowest reader, as bench store times it
                per_reader.append([e - s for _, s, e, _, _ in results])
        for c in conns:
            c.send(("stop",))
        for c in conns:
            try:
                mem1.append(recv(c)[1])
            except (EOFError, TimeoutError):
                mem1.append({})
    finally:
        for c in conns[len(mem1):]:  # an error above: stop the rest now, not after a 10 s join each
            with contextlib.suppress(OSError, ValueError):
                c.send(("stop",))
        for p in procs:
            p.join(10)
            if p.is_alive():
                p.kill()
                p.join(5)
    held = [sum(n for group in mine for _, _, n in group) for mine in calls if mine] + \
        [sum(hi - lo for _, lo, hi in s) for s in shards]
    processes = [process_memory(role, p.exitcode, m0, m1, h, m1.get("anon", 0), m1.get("rss", 0), True)
                 for role, p, m0, m1, h in zip(roles, procs, mem0, mem1, held)]
    bad = [f"raw Mooncake {o['role']} exited with {o['exitcode']}" for o in processes if o["exitcode"] != 0]
    if bad:
        raise RuntimeError("; ".join(bad))

    e2e_s = [w + r for w, r in zip(write_s, read_s)]
    gb = total / 1e9
    return {
        "master_address": master, "bytes": total, "keys": len(sizes), "readers": readers, "writers": len(writer_conns),
        "shard": shard, "max_keys_per_call": max_keys_per_call,
        "repeats": repeats, "warmup": warmup,
        "write_gbps": _stats([gb / s for s in write_s]),
        "read_gbps": _stats([gb / s for s in read_s]),
        "e2e_gbps": _stats([gb / s for s in e2e_s]),
        "write_s": write_s, "read_s": read_s, "e2e_s": e2e_s, "per_reader_read_s": per_reader,
        "processes": processes, **setups,
    }
