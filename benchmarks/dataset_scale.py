"""Datasets at the size people train on: peak memory and wall time of a short run against the file's rows.

    python benchmarks/dataset_scale.py --rows 2000 300000 --copies 30 --repeats 3
    python benchmarks/dataset_scale.py --rows 2000 1800000 --copies 100 --repeats 1
    python benchmarks/dataset_scale.py --rows 2000 100000 --copies 1 --val-copies 1 --val-disjoint --tree ../before

For each row count it writes a train and a validation file in verl's layout (data_source, prompt as chat
messages, reward_model.ground_truth, extra_info with its own index) where every prompt is repeated --copies
times and the validation file (30 of them x --val-copies) shares its prompts with the train file (verl's DAPO-Math-17k: 17k prompts x
100; aime-2024: 30 x 32). It then runs `dataplane-rl train` on them (--steps steps of the embedded tiny config,
examples/reward.py as the reward), sampling every process under it (driver, Ray, actors) every 50 ms, and
prints per row count the median peak of their summed RSS and the median wall time, and their excess over the
smallest row count. The first run of a file makes its Arrow copy in the cache (tasks/dataset_file.py): it is
reported apart, as `first`, and the medians are of the runs after it. --tree DIR runs another checkout's code
(PYTHONPATH=DIR) to compare two versions on the same machine in the same hour.
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
    checked = check_rows(train, out)
    return {"peak_rss_mb": peak / 2**20, "wall_s": wall, "samples_checked": checked}


def check_rows(train: Path, out: Path) -> int:
    """Every trained sample was scored on its own row: its dataset_row's ground truth and prompt, and the reward
    examples/reward.py gives its response for that row. Returns how many were checked."""
    sys.path.insert(0, str(ROOT / "examples"))
    try:
        from reward import compute_score
    finally:
        sys.path.pop(0)
    samples = [json.loads(x) for f in sorted((out / "train_data").iterdir()) for x in f.read_text().splitlines()]
    if not samples or "dataset_row" not in samples[0]:  # code that names no row (older versions, --tree): nothing to check
        return 0
    rows = pq.read_table(train).take(pa.array([s["dataset_row"] for s in samples])).to_pylist()
    for s, row in zip(samples, rows):
        want = compute_score(row["data_source"], s["response"], row["reward_model"]["ground_truth"], row["extra_info"])
        if (s["ground_truth"] != row["reward_model"]["ground_truth"] or row["prompt"][0]["content"] not in s["prompt"]
                or abs(s["total_reward"] - want["score"]) > 1e-6):
            raise SystemExit(f"{out}: sample {s['sample_id']} was not scored on its row {s['dataset_row']}: {s} vs {row}")
    return len(samples)


STARTUP = """
import json, resource, sys, time
from dataplane_rl.config import load_config
from dataplane_rl.model.load import build_tiny, load_tokenizer
from dataplane_rl.tasks import load_task
tok = load_tokenizer(build_tiny(0))
cfg = load_config(None, ["task.name=dataset", f"task.path={sys.argv[1]}", f"task.val_path={sys.argv[2]}"])
before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
t0 = time.perf_counter()
task = load_task(cfg.task, tok)
prompts = task.prompts(0, 1, 0, 16)
t = time.perf_counter() - t0
print(json.dumps({"s": t, "mb": (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before) / 1024}))
"""


def startup(tree: Path, train: Path, val: Path, cache: Path) -> dict:
    """One process loading the task as the driver does (older versions did it in every actor too): seconds and the
    growth of its peak RSS."""
    env = dict(os.environ, PYTHONPATH=str(tree), DATAPLANE_RL_CACHE=str(cache))
    p = subprocess.run([sys.executable, "-c", STARTUP, str(train), str(val)], env=env, cwd=tree, capture_output=True,
                       text=True, timeout=1800)
    if p.returncode != 0:
        raise SystemExit(f"loading {train} failed:\n{p.stderr[-2000:]}")
    return json.loads(p.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rows", type=int, nargs="+", default=[2000, 300_000])
    ap.add_argument("--copies", type=int, default=30)
    ap.add_argument("--val-copies", type=int, default=32, help="copies of each of the 30 validation prompts")
    ap.add_argument("--val-disjoint", action="store_true",
                    help="validation prompts not in the train file (older versions refused shared ones)")
    ap.add_argument("--steps", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--tree", type=Path, default=ROOT, help="the checkout whose code runs (default: this one)")
    ap.add_argument("--json", type=Path)
    ap.add_argument("--startup", action="store_true",
                    help="time only the task's loading in one process (the part that grows with the rows), not whole runs")
    args = ap.parse_args()
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        for n in args.rows:
            train, val = tmp / f"train-{n}.parquet", tmp / f"val-{n}.parquet"
            t0 = time.perf_counter()
            rng = np.random.default_rng(n)
            v = rng.permutation(10**7)[:n // args.copies + 30]  # distinct sums: a prompt is repeated only --copies times
            a, b = v // 10000, v % 10000
            pq.write_table(verl_table(a[:-30], b[:-30], args.copies, "train", 0), train, row_group_size=min(n, 1 << 20))
            # aime-2024's shape (30 x 32), its prompts shared with the train file (or not: --val-disjoint)
            val_a, val_b = (a[-30:], b[-30:]) if args.val_disjoint else (a[:30], b[:30])
            pq.write_table(verl_table(val_a, val_b, args.val_copies, "val", 1), val)
            print(f"{n} rows: files written in {time.perf_counter() - t0:.1f} s ({train.stat().st_size / 2**20:.1f} MB "
                  "Parquet)", file=sys.stderr, flush=True)
            cache = tmp / f"cache-{n}"
            if args.startup:
                loads = [startup(args.tree, train, val, cache) for _ in range(args.repeats + 1)]
                shown = ", ".join(f"{x['s']:.2f} s +{x['mb']:.0f} MB" for x in loads)
                print(f"  task loading: {shown} (the first makes the copy)", file=sys.stderr, flush=True)
                results[n] = {"first": loads[0], "s": statistics.median(x["s"] for x in loads[1:] or loads),
                              "mb": statistics.median(x["mb"] for x in loads[1:] or loads)}
                continue
            runs = [run(args.tree, train, val, args.steps, cache, tmp / f"run-{n}-{i}") for i in range(args.repeats + 1)]
            for i, r in enumerate(runs):
                print(f"  run {i}{' (first: makes the Arrow copy)' if i == 0 else ''}: peak {r['peak_rss_mb']:.0f} MB, "
                      f"{r['wall_s']:.1f} s; {r['samples_checked']} samples each scored on its own row",
                      file=sys.stderr, flush=True)
            rest = runs[1:] or runs
            results[n] = {"first": runs[0], "peak_rss_mb": statistics.median(r["peak_rss_mb"] for r in rest),
                          "wall_s": statistics.median(r["wall_s"] for r in rest)}
    if args.startup:
        print("| train rows | copies a prompt | task loading (s) | its peak RSS growth (MB) | first (makes the copy): s, MB |")
        print("| --- | --- | --- | --- | --- |")
        for n, r in results.items():
            print(f"| {n:,} | {args.copies} | {r['s']:.2f} | {r['mb']:.0f} | {r['first']['s']:.2f}, {r['first']['mb']:.0f} |")
        return
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
