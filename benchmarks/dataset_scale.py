"""Datasets at the size people train on: peak memory and wall time of a short run against the file's rows (issue 44).

    python benchmarks/dataset_scale.py --rows 2000 300000 --copies 30 --repeats 3
    python benchmarks/dataset_scale.py --rows 2000 1800000 --copies 100 --repeats 1
    python benchmarks/dataset_scale.py --rows 2000 100000 --copies 1 --val-copies 1 --tree ../before   # unique prompts

For each row count it writes a train and a validation file in verl's layout (data_source, prompt as chat
messages, reward_model.ground_truth, extra_info with its own index) where every prompt is repeated --copies
times and the validation file (30 of them x --val-copies) shares its prompts with the train file (verl's DAPO-Math-17k: 17k prompts x
100; aime-2024: 30 x 32). It then runs `dataplane-rl train` on them (--steps steps of the embedded tiny config,
examples/reward.py as the reward), sampling every process under it (driver, Ray, actors) every 50 ms, and
prints per row count the median peak of their summed RSS and the median wall time, and their excess over the
smallest row count. The first run of a file makes its Arrow copy in the cache (tasks/dataset_file.py): it is
reported apart, as `first`, and the medians are of the runs after it. --tree DIR runs another checkout's code
(PYTHONPATH=DIR) for a before/after in the same session.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import psutil
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

ROOT = Path(__file__).resolve().parents[1]


def verl_table(a: np.ndarray, b: np.ndarray, copies: int, split: str, seed: int) -> pa.Table:
    """The sums a+b, each repeated `copies` times in a seeded order; columns as verl writes them."""
    rng = np.random.default_rng(seed)
    distinct = len(a)
    n = distinct * copies
    content = pa.array([f"what is {x}+{y}?" for x, y in zip(a.tolist(), b.tolist())])
    truth = pa.array([str(x + y) for x, y in zip(a.tolist(), b.tolist())])
    which = pa.array(rng.permutation(np.arange(n) % distinct))
    messages = pa.ListArray.from_arrays(pa.array(np.arange(n + 1, dtype=np.int32)), pa.StructArray.from_arrays(
        [pa.array(["user"] * n), pc.take(content, which)], names=["role", "content"]))
    return pa.table({
        "data_source": pa.array(["add"] * n),
        "prompt": messages,
        "ability": pa.array(["math"] * n),
        "reward_model": pa.StructArray.from_arrays([pa.array(["rule"] * n), pc.take(truth, which)],
                                                   names=["style", "ground_truth"]),
        "extra_info": pa.StructArray.from_arrays([pa.array([split] * n), pa.array(np.arange(n))],
                                                 names=["split", "index"]),
    })


def run(tree: Path, train: Path, val: Path, steps: int, cache: Path, out: Path) -> dict:
    env = dict(os.environ, PYTHONPATH=str(tree), DATAPLANE_RL_CACHE=str(cache))
    cmd = [sys.executable, "-m", "dataplane_rl.cli.main", "train", "task.name=dataset", f"task.path={train}",
           f"task.val_path={val}", f"task.reward_function={ROOT / 'examples' / 'reward.py'}",
           f"grpo.max_num_steps={steps}", "grpo.val_period=0", "logger.progress=false", f"logger.run_dir={out}"]
    t0 = time.perf_counter()
    p = subprocess.Popen(cmd, env=env, cwd=tree, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    peak, root = 0, psutil.Process(p.pid)
    while p.poll() is None:
        total = 0
        try:
            for q in [root, *root.children(recursive=True)]:
                try:
                    total += q.memory_info().rss
                except psutil.Error:
                    pass
        except psutil.Error:
            pass
        peak = max(peak, total)
        time.sleep(0.05)
    wall = time.perf_counter() - t0
    stdout, stderr = p.communicate()
    if p.returncode != 0:
        raise SystemExit(f"run on {train} failed ({p.returncode}):\n{stderr[-3000:]}")
    return {"peak_rss_mb": peak / 2**20, "wall_s": wall}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rows", type=int, nargs="+", default=[2000, 300_000])
    ap.add_argument("--copies", type=int, default=30)
    ap.add_argument("--val-copies", type=int, default=32, help="copies of each of the 30 validation prompts")
    ap.add_argument("--steps", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--tree", type=Path, default=ROOT, help="the checkout whose code runs (default: this one)")
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        for n in args.rows:
            train, val = tmp / f"train-{n}.parquet", tmp / f"val-{n}.parquet"
            t0 = time.perf_counter()
            rng = np.random.default_rng(n)
            v = rng.permutation(10**6)[:n // args.copies]  # distinct sums: a prompt is repeated only --copies times
            a, b = v // 1000, v % 1000
            pq.write_table(verl_table(a, b, args.copies, "train", 0), train, row_group_size=min(n, 1 << 20))
            # aime-2024's shape (30 x 32), its prompts shared with the train file
            pq.write_table(verl_table(a[:30], b[:30], args.val_copies, "val", 1), val)
            print(f"{n} rows: files written in {time.perf_counter() - t0:.1f} s ({train.stat().st_size / 2**20:.1f} MB "
                  "Parquet)", file=sys.stderr, flush=True)
            cache = tmp / f"cache-{n}"
            runs = [run(args.tree, train, val, args.steps, cache, tmp / f"run-{n}-{i}") for i in range(args.repeats + 1)]
            for i, r in enumerate(runs):
                print(f"  run {i}{' (first: makes the Arrow copy)' if i == 0 else ''}: peak {r['peak_rss_mb']:.0f} MB, "
                      f"{r['wall_s']:.1f} s", file=sys.stderr, flush=True)
            rest = runs[1:] or runs
            results[n] = {"first": runs[0], "peak_rss_mb": statistics.median(r["peak_rss_mb"] for r in rest),
                          "wall_s": statistics.median(r["wall_s"] for r in rest)}
    base = results[min(results)]
    print("| train rows (validation: 30 of its prompts x 32) | copies a prompt | peak RSS, all processes (MB) | over the smallest | wall (s) | over the smallest | "
          "first run (makes the copy): peak MB, wall s |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for n, r in results.items():
        print(f"| {n:,} | {args.copies} | {r['peak_rss_mb']:.0f} | {r['peak_rss_mb'] - base['peak_rss_mb']:+.0f} | "
              f"{r['wall_s']:.1f} | {r['wall_s'] - base['wall_s']:+.1f} | {r['first']['peak_rss_mb']:.0f}, "
              f"{r['first']['wall_s']:.1f} |")
    if args.json:
        args.json.write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
