"""`bench store`'s references on the same bytes, writers and readers: memcpy, the shm floor, fresh tmpfs pages, raw
Mooncake and the Mooncake floor (raw with the copies and checksums)."""

from __future__ import annotations

import time
from typing import Any

import numpy as np
import pyarrow as pa

from dataplane_rl.bench.store_procs import Pool, serve
from dataplane_rl.bench.store_work import (
    Workload,
    _stats,
    make_groups,
    memory,
    piece_sizes,
    row_lengths,
    shard_pieces,
    touch,
    views_of,
    writer_groups,
)


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


def raw_mooncake(work: Workload, cluster, checksummed: bool = False) -> dict[str, Any]:
    """Raw Mooncake batch_put_from / batch_get_into of the same bytes: one key per group (its buffers back to
    back, as the store keeps one object per put), each put with its own batch_put_from by the same writers
    (groups interleaved as theirs), one batch_get_into per reader of its groups' keys, then its touch of every
    byte it read, timed with the read, as the store's readers and the other references' readers touch theirs.
    `checksummed` (the Mooncake floor): the writers also copy each group's buffers into their arena and
    checksum each before its put, and the readers checksum each piece before the touch, as the shm floor does."""
    from dataplane_rl.bench.raw_mooncake import raw_mooncake_roundtrip

    groups = make_groups(work.samples, work.min_len, work.max_len, work.groups(), topk=work.topk)
    pieces = [[v.view(np.uint8) for v in views_of(pa.table(cols))] for cols in groups]
    del groups
    res = raw_mooncake_roundtrip(cluster, [np.concatenate(p) for p in pieces], repeats=work.repeats,
                                 readers=work.readers, writers=work.writers, group_of=range(len(pieces)),
                                 touching=True, pieces=pieces if checksummed else None)
    return {k: res[k] for k in ("write_gbps", "read_gbps", "e2e_gbps", "processes")}


# ---- memcpy and the shm floor: the harness's processes doing only what no store can skip ------------
def _layout(work: Workload) -> tuple[np.ndarray, list[tuple[int, int]], list[int], int]:
    """Row lengths, the groups' rows, each group's first byte in a group-major mapping, and its size."""
    lengths = row_lengths(work.samples, work.min_len, work.max_len)
    ranges = work.groups()
    sizes = [sum(piece_sizes(lengths[lo:hi], work.topk)) for lo, hi in ranges]
    starts = np.concatenate([[0], np.cumsum(sizes)]).astype(int).tolist()
    return lengths, ranges, starts[:-1], starts[-1]


def _ref_writer(conn, barrier, path: str, w: int, work: Workload, checksum: bool, profile: str) -> None:
    """Copies its groups' buffers into the mapping, each group's back to back at its place (a store's
    block per put), checksumming each piece if `checksum`."""
    def setup():
        import mmap
        import os

        import xxhash

        lengths, ranges, starts, total = _layout(work)
        mine = writer_groups(list(zip(ranges, starts)), w, work.writers)
        groups = make_groups(work.samples, work.min_len, work.max_len, [r for r, _ in mine], topk=work.topk)
        srcs = []  # (where, bytes view) per buffer
        for ((lo, hi), start), cols in zip(mine, groups):
            views = [v.view(np.uint8) for v in views_of(pa.table(cols))]
            if [v.size for v in views] != piece_sizes(lengths[lo:hi], work.topk):
                raise RuntimeError(f"group rows {lo}-{hi}: its buffers are not the layout's sizes")
            at = start
            for v in views:
                srcs.append((at, v))
                at += v.size
        fd = os.open(path, os.O_RDWR)
        st = {"mm": mmap.mmap(fd, total)}
        st["dst"] = np.frombuffer(st["mm"], dtype=np.uint8)
        nbytes = sum(v.size for _, v in srcs)

        def handle(msg) -> dict:
            dst = st["dst"]
            t0, c0 = time.perf_counter(), time.thread_time()
            for at, src in srcs:  # one copy and (floor) one checksum per piece, nothing else
                part = dst[at:at + src.size]
                np.copyto(part, src)
                if checksum:
                    xxhash.xxh3_64_intdigest(part)
            t1 = time.perf_counter()
            return {"t0": t0, "t1": t1, "calls": len(mine), "bytes": nbytes, "busy": t1 - t0,
                    "round_cpu": time.thread_time() - c0, "mem": memory()}

        def close() -> None:
            mm = st.pop("mm")
            st.clear()  # every view of the map goes before the map (else: BufferError, exported pointers)
            mm.close()
            os.close(fd)

        return handle, close

    serve(conn, barrier, setup, profile)


def _ref_reader(conn, barrier, path: str, rows: tuple[int, int], work: Workload, checksum: bool,
                profile: str) -> None:
    """Touches (and with `checksum`, checksums) the pieces of its shard's rows, where the writers put them."""
    def setup():
        import mmap
        import os

        import xxhash

        lengths, ranges, starts, total = _layout(work)
        pieces = shard_pieces(lengths, ranges, starts, *rows, topk=work.topk)
        fd = os.open(path, os.O_RDONLY)
        st = {"mm": mmap.mmap(fd, total, prot=mmap.PROT_READ)}
        data = np.frombuffer(st["mm"], dtype=np.uint8)
        st["parts"] = [data[at:at + n] for at, n in pieces]
        del data

        def handle(msg) -> dict:
            t0, c0 = time.perf_counter(), time.thread_time()
            if checksum:
                for p in st["parts"]:
                    xxhash.xxh3_64_intdigest(p)
            touched = touch(st["parts"])
            t1 = time.perf_counter()
            return {"t0": t0, "t1": t1, "calls": 1, "bytes": touched, "busy": t1 - t0,
                    "round_cpu": time.thread_time() - c0, "mem": memory()}

        def close() -> None:
            mm = st.pop("mm")
            st.clear()  # the views before the map: a live one makes close() raise BufferError
            mm.close()
            os.close(fd)

        return handle, close

    serve(conn, barrier, setup, profile)


def ref_pool(name: str, work: Workload):
    """memcpy or shm_floor: the workload's writers and readers over one pre-touched shared mapping;
    returns the Pool and a function that removes the mapping's file."""
    import mmap
    import os
    import uuid

    checksum = name == "shm_floor"
    total = _layout(work)[3]
    path = f"/dev/shm/.dataplane-rl-bench-{name}-{uuid.uuid4().hex}"
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        os.posix_fallocate(fd, 0, total)
        mmap.mmap(fd, total, flags=mmap.MAP_SHARED | mmap.MAP_POPULATE).close()  # pre-touched
    finally:
        os.close(fd)

    def remove() -> None:
        try:
            os.unlink(path)
        except FileNotFoundError:
            pass

    try:
        pool = Pool(name, _ref_writer,
                    [(path, w, work, checksum, work.profile_path(name, f"writer {w}")) for w in range(work.writers)],
                    _ref_reader, [(path, s, work, checksum, work.profile_path(name, f"reader {i}"))
                                  for i, s in enumerate(work.shards())])
    except BaseException:
        remove()
        raise
    return pool, remove
