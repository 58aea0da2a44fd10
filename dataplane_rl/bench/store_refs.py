"""`bench store`'s references on the same bytes: memcpy, fresh tmpfs pages, the shm floor, raw Mooncake."""

from __future__ import annotations

import time
from typing import Any

import numpy as np
import pyarrow as pa

from dataplane_rl.bench.store_work import _stats, touch, views_of


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


# ---- the shm floor: what the harness allows a store that copies once and checksums ------------------
def _floor_writer(path: str, nbytes: int, conn, samples: int, min_len: int, max_len: int, topk: int = 0) -> None:
    import mmap
    import os

    import xxhash

    from dataplane_rl.bench.store_work import make_batch

    srcs = [v.view(np.uint8) for v in views_of(pa.table(make_batch(samples, min_len, max_len, topk=topk))) if v.size]
    fd = os.open(path, os.O_RDWR)
    mm = mmap.mmap(fd, nbytes)
    dst = np.frombuffer(mm, dtype=np.uint8)
    conn.send("ready")
    while conn.recv() is not None:
        t0, at = time.perf_counter(), 0
        for src in srcs:  # one copy and one checksum per buffer, nothing else
            part = dst[at:at + src.size]
            np.copyto(part, src)
            xxhash.xxh3_64_intdigest(part)
            at += src.size
        conn.send(time.perf_counter() - t0)
    del dst
    mm.close()
    os.close(fd)


def _floor_reader(path: str, nbytes: int, sizes: list[int], conn, barrier, share: tuple[int, int]) -> None:
    import mmap
    import os

    import xxhash

    fd = os.open(path, os.O_RDONLY)
    mm = mmap.mmap(fd, nbytes, prot=mmap.PROT_READ)
    data = np.frombuffer(mm, dtype=np.uint8)
    parts, at = [], 0
    for n in sizes:  # this reader's share of each buffer, as a row shard has of each column
        parts.append(data[at + n * share[0] // share[1]:at + n * (share[0] + 1) // share[1]])
        at += n
    conn.send("ready")
    while conn.recv() is not None:
        barrier.wait()
        t0 = time.perf_counter()
        for p in parts:
            xxhash.xxh3_64_intdigest(p)
        touched = touch(parts)
        conn.send((t0, time.perf_counter(), touched))
    del data, parts
    mm.close()
    os.close(fd)


def shm_floor(samples: int, min_len: int, max_len: int, readers: int, repeats: int, nbytes: int,
              recv, topk: int = 0) -> dict[str, Any]:
    """The floor of this harness for an shm store: the store's processes and hand-offs (a writer process,
    `readers` processes released by a barrier, pipes between rounds), and only the work no checksummed
    shm store can skip: the writer copies each buffer of the batch into a pre-touched shared mapping
    and checksums it, each reader checksums its share of each buffer and touches it. No catalog,
    validation, Arrow objects or locks. Timed like a store's rounds (`recv(conn, procs)`: bench.store's)."""
    import multiprocessing as mp
    import os
    import uuid

    from dataplane_rl.bench.store_work import make_batch

    sizes = [v.nbytes for v in views_of(pa.table(make_batch(samples, min_len, max_len, topk=topk))) if v.size]
    path = f"/dev/shm/.dataplane-rl-bench-floor-{uuid.uuid4().hex}"
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
    ctx = mp.get_context("spawn")
    procs, pipes = [], []
    try:
        os.posix_fallocate(fd, 0, sum(sizes))
        import mmap

        mmap.mmap(fd, sum(sizes), flags=mmap.MAP_SHARED | mmap.MAP_POPULATE).close()  # pre-touched
        barrier = ctx.Barrier(readers)
        w_parent, w_child = ctx.Pipe()
        procs.append(ctx.Process(target=_floor_writer, args=(path, sum(sizes), w_child, samples, min_len, max_len, topk),
                                 daemon=True))
        for i in range(readers):
            parent, child = ctx.Pipe()
            pipes.append(parent)
            procs.append(ctx.Process(target=_floor_reader, args=(path, sum(sizes), sizes, child, barrier, (i, readers)),
                                     daemon=True))
        for p in procs:
            p.start()
        for c in [w_parent, *pipes]:
            if recv(c, procs, 120) != "ready":
                raise RuntimeError("a floor worker failed to start")
        rounds = []
        for _ in range(repeats + 2):
            w_parent.send(1)
            w = recv(w_parent, procs)
            for c in pipes:
                c.send(1)
            r = max(t1 - t0 for t0, t1, _ in (recv(c, procs) for c in pipes))
            rounds.append((w, r))
        for c in [w_parent, *pipes]:
            c.send(None)
    finally:
        for p in procs:
            p.join(timeout=30)
            if p.is_alive():
                p.kill()
        os.close(fd)
        os.unlink(path)
    steady = rounds[2:]
    return {"write_gbps": _stats([nbytes / w / 1e9 for w, _ in steady]),
            "read_gbps": _stats([nbytes / r / 1e9 for _, r in steady]),
            "e2e_gbps": _stats([nbytes / (w + r) / 1e9 for w, r in steady])}
