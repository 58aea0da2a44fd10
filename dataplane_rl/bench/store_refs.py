"""`bench store`'s references on the same bytes: memcpy, fresh tmpfs pages, raw Mooncake."""

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
