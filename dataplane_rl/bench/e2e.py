"""End-to-end GRPO step time and the data plane's share of it, per transport.

Runs the same short training with the data plane off, on shm and on Mooncake, and reports the median
step time (first step excluded: it warms up), the seconds spent in store puts and gets, bytes moved per
step and bytes the driver read. The data plane's share is store seconds / step seconds, where store
seconds sum every put and get of every actor (an upper bound: actors run in parallel).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time

TRANSPORTS = {"off": ["data_plane.enabled=false"], "shm": ["data_plane.enabled=true", "data_plane.backend=shm://"],
              "mooncake": ["data_plane.enabled=true", "data_plane.backend=mooncake://"]}


def measure(transport: str, steps: int, extra: list[str]) -> dict:
    from dataplane_rl.config import load_config
    from dataplane_rl.train.loop import train

    with tempfile.TemporaryDirectory() as d:
        cfg = load_config(None, [*TRANSPORTS[transport], f"grpo.max_num_steps={steps}", f"logger.run_dir={d}",
                                 "logger.progress=false", *extra])
        t0 = time.perf_counter()
        train(cfg)
        wall = time.perf_counter() - t0
        rows = [json.loads(x) for x in open(f"{d}/metrics.jsonl")]
    timed = rows[1:] or rows
    step_s = statistics.median(r["timing/step"] for r in timed)
    dp_s = statistics.median(r["data_plane/seconds"] for r in timed)
    return {
        "transport": transport,
        "step_s": step_s,
        "data_plane_s": dp_s,
        "data_plane_share": dp_s / step_s,
        "bytes_per_step": statistics.median(r["data_plane/bytes_written"] + r["data_plane/bytes_read"] for r in timed),
        "driver_bytes_read": statistics.median(r["data_plane/driver_bytes_read"] for r in timed),
        "generate_s": statistics.median(r["timing/generate"] for r in timed),
        "train_s": statistics.median(r["timing/train"] for r in timed),
        "wall_s": wall,
        "steps": steps,
    }


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--transports", default="off,shm,mooncake", help="comma list of off, shm, mooncake")
    p.add_argument("--steps", type=int, default=6, help="steps per transport (the first is not timed)")
    p.add_argument("--json", help="write the results here")
    p.add_argument("overrides", nargs="*", metavar="key=value", help="config overrides for every run")


def run_args(args) -> int:
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    results = []
    for t in args.transports.split(","):
        if t not in TRANSPORTS:
            print(f"error: unknown transport '{t}'; use {', '.join(TRANSPORTS)}", file=sys.stderr)
            return 2
        print(f"[e2e] {t}: {args.steps} steps ...", file=sys.stderr, flush=True)
        results.append(measure(t, args.steps, args.overrides))
    print(f"{'transport':<10}{'step s':>9}{'store s':>9}{'share':>8}{'MB/step':>9}{'driver KB':>11}")
    for r in results:
        print(f"{r['transport']:<10}{r['step_s']:>9.3f}{r['data_plane_s']:>9.4f}{100 * r['data_plane_share']:>7.2f}%"
              f"{r['bytes_per_step'] / 1e6:>9.2f}{r['driver_bytes_read'] / 1e3:>11.1f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"results": results, "date": time.strftime("%Y-%m-%d")}, f, indent=2)
    return 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="e2e_step", description=__doc__.splitlines()[0])
    add_arguments(p)
    return run_args(p.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
