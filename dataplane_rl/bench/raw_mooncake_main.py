"""Raw Mooncake throughput run standalone (starts its own cluster unless given a master):

    python benchmarks/raw_mooncake.py --samples 512 --layout per-sample --layout per-column --readers 1 2
    python -m dataplane_rl.bench.raw_mooncake_main ...     # the same

The measurement itself is dataplane_rl/bench/raw_mooncake.py's raw_mooncake_roundtrip.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from typing import Any, Sequence

import numpy as np

from dataplane_rl.bench.raw_mooncake import DEFAULT_COLUMN_BYTES, raw_mooncake_roundtrip


def synthetic_buffers(samples: int = 512, column_bytes: Sequence[int] = DEFAULT_COLUMN_BYTES,
                      layout: str = "per-sample", seed: int = 0) -> list[np.ndarray]:
    """Random bytes shaped like a batch: per-sample = one key per (sample, column), sample-major;
    per-column = one key per column holding all samples; per-row = one key per sample."""
    rng = np.random.default_rng(seed)
    cols = [rng.integers(0, 256, samples * w, dtype=np.uint8) for w in column_bytes]
    if layout == "per-column":
        return cols
    if layout == "per-sample":
        return [c[i * w:(i + 1) * w] for i in range(samples) for c, w in zip(cols, column_bytes)]
    if layout == "per-row":
        return [np.concatenate([c[i * w:(i + 1) * w] for c, w in zip(cols, column_bytes)]) for i in range(samples)]
    raise ValueError(f"layout must be per-sample, per-column or per-row, got {layout!r}")


def _fmt(s: dict) -> str:
    return f"{s['median']:6.3f} ({s['min']:.3f}-{s['max']:.3f})"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--address", default="", help="existing master HOST:PORT (default: start a local cluster)")
    p.add_argument("--holders", type=int, default=1)
    p.add_argument("--segment-mb", type=int, default=256)
    p.add_argument("--samples", type=int, default=512)
    p.add_argument("--layout", action="append", choices=["per-sample", "per-column", "per-row"])
    p.add_argument("--readers", type=int, nargs="+", default=[1, 2])
    p.add_argument("--shard", choices=["keys", "bytes", "auto"], default="auto",
                   help="auto: keys for per-sample/per-row, bytes for per-column")
    p.add_argument("--repeats", type=int, default=10)
    p.add_argument("--json", default="", help="also write all results to this file")
    args = p.parse_args(argv)
    layouts = args.layout or ["per-sample", "per-column"]

    from dataplane_rl.store.mooncake.cluster import MooncakeCluster

    cluster = None
    if args.address:
        target: Any = args.address
    else:
        t0 = time.monotonic()
        cluster = MooncakeCluster(args.holders, args.segment_mb << 20).start()
        print(f"cluster {cluster.master_address}: {args.holders} holder(s) x {args.segment_mb} MB, "
              f"started in {time.monotonic() - t0:.2f}s")
        target = cluster
    out = []
    try:
        for layout in layouts:
            bufs = synthetic_buffers(args.samples, layout=layout)
            shard = args.shard if args.shard != "auto" else ("bytes" if layout == "per-column" else "keys")
            for r in args.readers:
                res = raw_mooncake_roundtrip(target, bufs, args.repeats, r, shard=shard)
                res["layout"] = layout
                out.append(res)
                print(f"{layout:10s} {res['keys']:5d} keys {res['bytes'] / 1e6:6.2f} MB  readers={r} shard={shard:5s} "
                      f"GB/s median (min-max): write {_fmt(res['write_gbps'])}  read {_fmt(res['read_gbps'])}  "
                      f"e2e {_fmt(res['e2e_gbps'])}", flush=True)
    finally:
        if cluster is not None:
            cluster.close()
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
