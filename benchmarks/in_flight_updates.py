"""In-flight weight updates: age-2 async GRPO with and without them, and every token checked against
the weights of its recorded version.

    python benchmarks/in_flight_updates.py --steps 100 --max-new-tokens 200 --json in-flight.json
    python benchmarks/in_flight_updates.py --verify-steps 24 --max-new-tokens 200 --modes ''

Compare: one `dataplane-rl train` run per mode (off; on with the KV cache recomputed after a refit; on with the
stale cache kept), one after the other, on the default task with `max_trajectory_age_steps=2`, `tis` at 2.0 and
the data plane on. --max-new-tokens sets how long the tiny model may answer: its answers run until it samples the
end token, so their lengths are long-tailed (at 200, a step's generation outlasts a training step on 2 cores and
refits arrive while actors generate; at the default 8 they never do). Printed per mode: last-quarter train
reward, final validation, the refits that landed inside generations, mixed-version samples, token age,
staleness, dropped rows, steps/s, the trainer's wait for rollouts, and the rollout actors' idle fraction (from
the run's trace: 1 - the sum of their `generate` spans over the run's span).

Verify (--verify-steps N > 0): a run with in-flight updates and a recomputed cache, a checkpoint after every step
(version v's weights are checkpoint step v's; version 0 the initial model) and `logger.save_rollouts=true`. Every
generated token of every trained row is then scored, teacher-forced, under the weights of its
`token_policy_version`, and must give its stored `generation_logprobs` to 1e-5; scored under the version before
its own it must not (the versions' weights differ enough for the check to see a wrong one); no token may be older
than the age bound at the step that trained it. A checkpoint's save waits for the rounds in flight
(checkpoint/ahead.py), so this run's pipeline is not the comparison's; it checks the numbers, it does not time them.
"""

from __future__ import annotations

import argparse
import functools
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
BASE = ["grpo.async_grpo.enabled=true", "grpo.async_grpo.max_trajectory_age_steps=2",
        "loss_fn.use_importance_sampling_correction=true", "loss_fn.truncated_importance_sampling_type=tis",
        "loss_fn.truncated_importance_sampling_ratio=2.0", "data_plane.enabled=true", "logger.progress=false",
        "logger.tensorboard_enabled=false"]
MODES = {
    "off": [],
    "recompute": ["grpo.async_grpo.in_flight_weight_updates=true",
                  "grpo.async_grpo.recompute_kv_cache_after_weight_updates=true"],
    "keep": ["grpo.async_grpo.in_flight_weight_updates=true"],
}


def train(run_dir: Path, overrides: list[str]) -> float:
    """One `dataplane-rl train` run into run_dir; its wall seconds. A failed run stops the benchmark with its tail."""
    cmd = [sys.executable, "-m", "dataplane_rl.cli.main", "train", *BASE, f"logger.run_dir={run_dir}", *overrides]
    t0 = time.perf_counter()
    p = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
    if p.returncode != 0:
        sys.exit(f"error: the run {' '.join(overrides)} failed ({p.returncode}):\n{p.stderr[-3000:]}")
    return time.perf_counter() - t0


def idle_fraction(run_dir: Path) -> float:
    """1 - (the rollout actors' generate seconds) / (actors x the trained steps' span), from the run's trace."""
    events = json.loads((run_dir / "trace.json").read_text())["traceEvents"]
    names = {e["pid"]: e["args"]["name"] for e in events if e.get("ph") == "M" and e["name"] == "process_name"}
    actors = {p for p, n in names.items() if n.startswith("rollout-")}
    steps = [e for e in events if e.get("name") == "step" and e.get("ph") == "X"]
    span = max(e["ts"] + e["dur"] for e in steps) - min(e["ts"] for e in steps)
    busy = sum(e["dur"] for e in events if e.get("name") == "generate" and e.get("pid") in actors)
    return 1.0 - busy / (span * max(len(actors), 1))


def summary(run_dir: Path, wall: float) -> dict:
    ms = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    train = [m for m in ms if "train/reward" in m]
    n = len(train)
    last = train[n - n // 4:]
    val = [m["validation/reward"] for m in ms if "validation/reward" in m]
    col = lambda k: [m[k] for m in train if k in m]  # noqa: E731
    return {
        "steps": n,
        "reward_last_quarter": statistics.fmean(m["train/reward"] for m in last),
        "final_validation": val[-1] if val else None,
        "in_flight_refits": int(sum(col("async/in_flight_refits"))) if col("async/in_flight_refits") else None,
        "mixed_version_samples": (int(sum(col("async/mixed_version_samples")))
                                  if col("async/mixed_version_samples") else None),
        "token_age_mean": statistics.fmean(col("async/token_age_mean")) if col("async/token_age_mean") else None,
        "staleness_mean": statistics.fmean(col("async/staleness_mean")),
        "staleness_max": int(max(col("async/staleness_max"))),
        "dropped_stale": int(sum(col("async/dropped_stale"))),
        "wall_s": wall,
        "steps_per_s": n / sum(col("timing/step")),
        "wait_for_rollouts_s_mean": statistics.fmean(col("timing/wait_for_rollouts")),
        "generate_s_mean": statistics.fmean(col("timing/generate")),
        "response_length_mean": statistics.fmean(col("generation/response_length_mean")),
        "rollout_idle_fraction": idle_fraction(run_dir),
    }


def verify(run_dir: Path, steps: int, age: int = 2) -> dict:
    """Every generated token of every trained row under its version's weights (see the module docstring)."""
    import pyarrow.parquet as pq
    import torch

    from dataplane_rl.checkpoint.export import checkpoint_model_state
    from dataplane_rl.model.load import build_tiny, load_model
    from dataplane_rl.model.logprobs import token_logprobs
    from dataplane_rl.schema import load_schema
    from dataplane_rl.train.batch import build_train_batch

    schema = load_schema("grpo")
    model = load_model(build_tiny(0), torch.device("cpu"))
    initial = {k: v.clone() for k, v in model.state_dict().items()}
    ckpts = run_dir / "checkpoints"

    @functools.lru_cache(maxsize=age + 3)  # a step's tokens come from its last few versions: each read once
    def weights(v: int) -> dict:
        return initial if v == 0 else checkpoint_model_state(ckpts / f"step_{v:06d}", build_tiny(0))

    out = {"rows": 0, "mixed_rows": 0, "tokens": 0, "tokens_by_version_count": {}, "max_abs_error": 0.0,
           "previous_version_error_min": float("inf"), "oldest_token_age": 0}
    for step in range(1, steps + 1):
        table = pq.read_table(run_dir / "rollouts" / f"step_{step:06d}.parquet")
        batch = build_train_batch(table.select(["input_ids", "input_lengths", "token_mask", "generation_logprobs"]),
                                  schema)
        versions = torch.full(batch["input_ids"].shape, -2, dtype=torch.long)  # [B, T]; -2 in padding
        for i, row in enumerate(table.column("token_policy_version").to_pylist()):
            versions[i, :len(row)] = torch.tensor(row)
        spans = [len(set(r) - {-1}) for r in table.column("token_policy_version").to_pylist()]
        out["rows"] += len(spans)
        out["mixed_rows"] += sum(s > 1 for s in spans)
        for s in spans:
            out["tokens_by_version_count"][s] = out["tokens_by_version_count"].get(s, 0) + 1
        gen = versions[versions >= 0]
        out["oldest_token_age"] = max(out["oldest_token_age"], int((step - 1) - gen.min()))
        for v in sorted(set(gen.tolist())):
            model.load_state_dict(weights(v))
            with torch.no_grad():
                lp = token_logprobs(model, batch["input_ids"], batch["attention_mask"])  # [B, T]
            mine = versions == v
            err = float((lp[mine] - batch["generation_logprobs"][mine]).abs().max())
            out["tokens"] += int(mine.sum())
            out["max_abs_error"] = max(out["max_abs_error"], err)
            if v > 0:  # the same tokens under the version before: the check above would see a wrong version
                model.load_state_dict(weights(v - 1))
                with torch.no_grad():
                    lp = token_logprobs(model, batch["input_ids"], batch["attention_mask"])  # [B, T]
                wrong = float((lp[mine] - batch["generation_logprobs"][mine]).abs().max())
                out["previous_version_error_min"] = min(out["previous_version_error_min"], wrong)
    out["ok"] = (out["max_abs_error"] < 1e-5 and out["previous_version_error_min"] > 1e-4
                 and out["oldest_token_age"] <= age and out["mixed_rows"] > 0)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--steps", type=int, default=100)
    ap.add_argument("--max-new-tokens", type=int, default=200)
    ap.add_argument("--modes", default="off,recompute,keep", help="comma-separated, of off, recompute, keep")
    ap.add_argument("--verify-steps", type=int, default=0, help="a verified run of this many steps (0: none)")
    ap.add_argument("--out", type=Path, default=None, help="keep the run folders here (default: a temp folder)")
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args()
    work = args.out or Path(tempfile.mkdtemp(prefix="in-flight-"))
    gen = [f"generation.max_new_tokens={args.max_new_tokens}"]
    results: dict = {}
    for mode in [m for m in args.modes.split(",") if m]:
        run_dir = work / mode
        wall = train(run_dir, [f"grpo.max_num_steps={args.steps}", *gen, *MODES[mode]])
        results[mode] = summary(run_dir, wall)
        print(f"{mode}: {json.dumps(results[mode])}", flush=True)
    if args.verify_steps:
        run_dir = work / "verify"
        train(run_dir, [f"grpo.max_num_steps={args.verify_steps}", *gen, *MODES["recompute"],
                        "checkpointing.enabled=true", "checkpointing.save_period=1", "checkpointing.keep_top_k=null",
                        f"checkpointing.checkpoint_dir={run_dir / 'checkpoints'}", "logger.save_rollouts=true",
                        "grpo.val_period=0"])
        results["verify"] = verify(run_dir, args.verify_steps)
        print(f"verify: {json.dumps(results['verify'])}", flush=True)
    if results and any(m in results for m in MODES):
        keys = ["steps", "reward_last_quarter", "final_validation", "in_flight_refits", "mixed_version_samples",
                "token_age_mean", "staleness_mean", "staleness_max", "dropped_stale", "steps_per_s",
                "wait_for_rollouts_s_mean", "generate_s_mean", "response_length_mean", "rollout_idle_fraction"]
        print("| mode | " + " | ".join(keys) + " |\n|" + "---|" * (len(keys) + 1))
        for mode, r in results.items():
            if mode in MODES:
                cells = [f"{r[k]:.3f}" if isinstance(r[k], float) else str(r[k]) for k in keys]
                print(f"| {mode} | " + " | ".join(cells) + " |")
    if args.json:
        args.json.write_text(json.dumps(results, indent=1))
    if "verify" in results and not results["verify"]["ok"]:
        sys.exit("error: a token's log-prob is not its version's, a token is older than the age bound, or no row "
                 "crossed a refit (see verify above)")


if __name__ == "__main__":
    main()
