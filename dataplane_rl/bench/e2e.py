"""End-to-end GRPO step time and the data plane's share of it, per transport; or sync vs async GRPO.

Default: runs the same short training with the data plane off, on shm and on Mooncake, and reports the
median step time (first step excluded: it warms up), the seconds spent in store puts and gets, bytes moved
per step and bytes the driver read. The data plane's share is store seconds / step seconds, where store
seconds sum every put and get of every actor (an upper bound: actors run in parallel).

--async: per config (the default one, and a heavier one: the ~24M model of `bench generate` with
generation.max_new_tokens=64), sync and async GRPO (max_trajectory_age_steps=1) on shm, and reports the
median samples/s of each and two ratios: async / sync, and async / the ideal overlap. The ideal comes from
the same run's sync steps: a sync step is gen + train (gen = its wait for rollouts, train = the rest), and
perfect overlap would make a step max(gen, train).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time

TRANSPORTS = {"off": ["data_plane.enabled=false"], "shm": ["data_plane.enabled=true", "data_plane.backend=shm://"],
              "mooncake": ["data_plane.enabled=true", "data_plane.backend=mooncake://"]}


def measure(transport: str, steps: int, extra: list[str]) -> dict:
    from dataplane_rl.config import load_config
    from dataplane_rl.driver.loop import train

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


ASYNC_MODES = {"sync": ["grpo.async_grpo.enabled=false"],
               "async": ["grpo.async_grpo.enabled=true", "grpo.async_grpo.max_trajectory_age_steps=1"]}


def configs() -> dict[str, list[str]]:
    from dataplane_rl.bench.generate import model_folder

    return {"default": [], "heavy": [f"policy.model={model_folder('small-24m')}", "generation.max_new_tokens=64"]}


def measure_async(config: str, mode: str, steps: int, extra: list[str]) -> dict:
    """One run of `mode` on `config`: median samples/s and phase seconds over the steps after the first."""
    from dataplane_rl.config import load_config
    from dataplane_rl.driver.loop import train

    with tempfile.TemporaryDirectory() as d:
        # importance sampling in both modes: the same loss, so only the schedule differs
        cfg = load_config(None, ["data_plane.enabled=true", "data_plane.backend=shm://", *configs()[config],
                                 *ASYNC_MODES[mode], "loss_fn.use_importance_sampling_correction=true",
                                 f"grpo.max_num_steps={steps}", "grpo.val_period=0", f"logger.run_dir={d}",
                                 "logger.progress=false", "logger.tensorboard_enabled=false", *extra])
        train(cfg)
        rows = [json.loads(x) for x in open(f"{d}/metrics.jsonl")]
    timed = rows[1:] or rows
    med = lambda k: statistics.median(r[k] for r in timed)  # noqa: E731
    return {"config": config, "mode": mode, "samples_per_s": med("throughput/samples_per_s"),
            "wait_s": med("timing/wait_for_rollouts"), "generate_s": med("timing/generate"),
            "step_s": med("timing/step"), "staleness_mean": med("async/staleness_mean"),
            "samples_per_step": cfg.grpo.num_prompts_per_step * cfg.grpo.num_generations_per_prompt, "steps": steps}


def compare_async(config: str, steps: int, extra: list[str]) -> dict:
    sync, async_ = (measure_async(config, m, steps, extra) for m in ASYNC_MODES)
    n = sync["samples_per_step"]
    sync_step = n / sync["samples_per_s"]  # wall seconds per sync step, logging included
    gen = sync["wait_s"]  # a sync step waits for its whole generation
    train = sync_step - gen
    ideal = n / max(gen, train)
    return {"config": config, "sync": sync, "async": async_, "gen_s": gen, "train_s": train, "ideal_samples_per_s": ideal,
            "async_over_sync": async_["samples_per_s"] / sync["samples_per_s"],
            "async_over_ideal": async_["samples_per_s"] / ideal, "ideal_over_sync": ideal / sync["samples_per_s"]}


def run_async(args) -> int:
    names = args.configs.split(",")
    bad = [c for c in names if c not in ("default", "heavy")]
    if bad:
        print(f"error: unknown config '{bad[0]}'; use default, heavy", file=sys.stderr)
        return 2
    results = []
    for c in names:
        print(f"[e2e] {c}: sync and async, {args.steps} steps each ...", file=sys.stderr, flush=True)
        results.append(compare_async(c, args.steps, args.overrides))
    print("| config | sync samples/s | async samples/s | async / sync | gen s | train s | ideal samples/s "
          "| async / ideal |\n| --- | --- | --- | --- | --- | --- | --- | --- |")
    for r in results:
        print(f"| {r['config']} | {r['sync']['samples_per_s']:.1f} | {r['async']['samples_per_s']:.1f} | "
              f"{r['async_over_sync']:.2f}x | {r['gen_s']:.2f} | {r['train_s']:.2f} | {r['ideal_samples_per_s']:.1f} | "
              f"{100 * r['async_over_ideal']:.0f}% |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"results": results, "date": time.strftime("%Y-%m-%d"), "load": os.getloadavg(),
                       "cpus": os.cpu_count()}, f, indent=2)
    return 0


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--async", dest="async_", action="store_true",
                   help="compare sync and async GRPO (age 1) samples/s instead of transports")
    p.add_argument("--configs", default="default,heavy", help="with --async: comma list of default, heavy")
    p.add_argument("--transports", default="off,shm,mooncake", help="comma list of off, shm, mooncake")
    p.add_argument("--steps", type=int, default=6, help="steps per transport (the first is not timed)")
    p.add_argument("--json", help="write the results here")
    p.add_argument("overrides", nargs="*", metavar="key=value", help="config overrides for every run")


def run_args(args) -> int:
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    if args.async_:
        return run_async(args)
    results = []
    for t in args.transports.split(","):
        if t not in TRANSPORTS:
            print(f"error: unknown transport '{t}'; use {', '.join(TRANSPORTS)}", file=sys.stderr)
            return 2
        print(f"[e2e] {t}: {args.steps} steps ...", file=sys.stderr, flush=True)
        results.append(measure(t, args.steps, args.overrides))
    print(f"{'transport':<10}{'step s':>9}{'store s':>9}{'share':>8}{'kB/step':>9}{'driver kB':>11}")
    for r in results:
        print(f"{r['transport']:<10}{r['step_s']:>9.3f}{r['data_plane_s']:>9.4f}{100 * r['data_plane_share']:>7.2f}%"
              f"{r['bytes_per_step'] / 1e3:>9.1f}{r['driver_bytes_read'] / 1e3:>11.1f}")
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
