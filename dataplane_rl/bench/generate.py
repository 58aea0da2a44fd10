"""Generation throughput: the Hugging Face engine vs the vLLM engine, on the tiny model and a ~24M one.

Workload: N prompts of the `repeat` task (as token ids, with bos), one sample each with its own seed,
up to M new tokens, temperature 1: the GRPO rollout call, nothing else. tokens/s counts the tokens
actually generated (eos may end a sample early) over the wall time of one `generate` call.

Ceiling, measured in the same run: one teacher-forced HF forward over the same [N, prompt + M] tokens,
as N*M tokens per second of that forward: what decoding would reach if every token cost what it costs
inside one batched prefill.

Each engine lives in its own worker process (an in-process vLLM engine changes its process's thread
settings and cannot be torn down cleanly). Per model the workers start and warm up once, then the timed
calls alternate between them, repeat by repeat, so a busy neighbour on the machine slows every engine
alike; the median over repeats is reported.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

# name -> Qwen2 shape; 'tiny' is the training default (dataplane_rl.model.load.TINY)
SMALL_24M = dict(hidden_size=384, intermediate_size=3200, num_hidden_layers=6, num_attention_heads=6,
                 num_key_value_heads=2, max_position_embeddings=512)
MODELS = ("tiny", "small-24m")
BACKENDS = ("hf", "vllm")


def build_small(seed: int, cache_dir: str | None = None) -> Path:
    """Build (once) a ~24.5M-parameter Qwen2 with the tiny model's character tokenizer; return its folder."""
    from dataplane_rl.model.load import TINY_VERSION, build_tiny, cache_root, load_tokenizer

    folder = cache_root(cache_dir) / f"bench-qwen2-24m-v{TINY_VERSION}-seed{seed}"  # its tokenizer is the tiny one's
    if (folder / "model.safetensors").is_file() and (folder / "tokenizer.json").is_file():
        return folder
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    tok = load_tokenizer(build_tiny(seed, cache_dir))
    cfg = Qwen2Config(vocab_size=len(tok), tie_word_embeddings=True, bos_token_id=tok.bos_token_id,
                      eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id, **SMALL_24M)
    torch.manual_seed(seed)
    tmp = folder.with_name(folder.name + f".tmp{os.getpid()}")
    Qwen2ForCausalLM(cfg).save_pretrained(tmp)
    tok.save_pretrained(tmp)
    try:
        tmp.rename(folder)  # atomic: concurrent builders race harmlessly
    except OSError:
        import shutil

        shutil.rmtree(tmp, ignore_errors=True)
    return folder


def model_folder(name: str, seed: int = 0) -> Path:
    from dataplane_rl.model.load import build_tiny

    return build_tiny(seed) if name == "tiny" else build_small(seed)


def workload(tok, prompts: int, seed: int = 0) -> tuple[list[list[int]], list[int]]:
    from dataplane_rl.rollout.generation import sample_seed
    from dataplane_rl.tasks import get_task

    texts = get_task("repeat").prompts(seed, 1, 0, prompts)
    ids = [[tok.bos_token_id] + tok(t, add_special_tokens=False).input_ids for t in texts]
    return ids, [sample_seed(seed, 1, 0, i, 0) for i in range(prompts)]


def _stats(xs: list[float]) -> dict[str, float]:
    return {"median": statistics.median(xs), "min": min(xs), "max": max(xs)}


def serve(model: str, backend: str, prompts: int, max_new_tokens: int) -> None:
    """Worker process: build and warm up one engine, then answer one timed call per stdin line.

    Lines: 'generate' -> {"tokens", "seconds"}; 'ceiling' (hf only) -> {"tokens", "seconds"} of the
    teacher-forced forward. The protocol uses the original stdout; everything else printed goes to stderr.
    """
    import torch

    from dataplane_rl.config import load_config
    from dataplane_rl.rollout.engine import make_engine
    from dataplane_rl.model.load import load_tokenizer

    out = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)  # vLLM and tqdm print to stdout: keep the protocol line-clean

    def reply(obj) -> None:
        out.write(json.dumps(obj) + "\n")
        out.flush()

    torch.set_num_threads(os.cpu_count() or 1)
    folder = model_folder(model)
    tok = load_tokenizer(folder)
    cfg = load_config(None, [f"generation.backend={backend}", f"policy.model={folder}"])
    t0 = time.perf_counter()
    engine = make_engine(cfg, folder, tok)
    startup = time.perf_counter() - t0
    ids, seeds = workload(tok, prompts)
    engine.generate(ids, seeds, max_new_tokens, 1.0, 0)  # warm-up
    info = {"startup_s": startup}
    if backend == "hf":
        info["params"] = sum(p.numel() for p in engine.model.parameters())
        forced = teacher_forced_ids(engine.model, ids, max_new_tokens)
        with torch.no_grad():
            engine.model(input_ids=forced)  # warm-up
    reply(info)
    for line in sys.stdin:
        t0 = time.perf_counter()
        if line.strip() == "ceiling":
            with torch.no_grad():
                engine.model(input_ids=forced).logits.float().log_softmax(-1)  # [N, T, V]
            reply({"tokens": len(ids) * max_new_tokens, "seconds": time.perf_counter() - t0})
        else:
            gens = engine.generate(ids, seeds, max_new_tokens, 1.0, 0)
            reply({"tokens": sum(len(g.tokens) for g in gens), "seconds": time.perf_counter() - t0})


def teacher_forced_ids(model, prompts: list[list[int]], max_new_tokens: int):
    """[N, P + M] token ids for the ceiling's forward (random: a forward's cost does not depend on them)."""
    import torch

    T = max(map(len, prompts)) + max_new_tokens
    ids = torch.randint(3, model.config.vocab_size, (len(prompts), T), generator=torch.Generator().manual_seed(0))
    return ids.to(next(model.parameters()).device)  # [N, T]


class Worker:
    """A `serve` subprocess for one (model, backend)."""

    def __init__(self, model: str, backend: str, prompts: int, max_new_tokens: int) -> None:
        import tempfile

        self.name = f"{model}/{backend}"
        self.log = tempfile.TemporaryFile("w+")
        cmd = [sys.executable, "-m", "dataplane_rl.bench.generate", "--serve", f"{model}:{backend}",
               "--prompts", str(prompts), "--max-new-tokens", str(max_new_tokens)]
        self.proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self.log, text=True)
        self.info = self._read()

    def _read(self) -> dict:
        line = self.proc.stdout.readline()
        if not line:
            self.proc.wait()
            self.log.seek(0)
            tail = "\n".join(self.log.read().splitlines()[-8:])
            raise RuntimeError(f"bench generate worker {self.name} failed (exit {self.proc.returncode}):\n{tail}")
        return json.loads(line)

    def call(self, what: str) -> float:
        """One timed call; returns tokens per second."""
        self.proc.stdin.write(what + "\n")
        self.proc.stdin.flush()
        r = self._read()
        return r["tokens"] / r["seconds"]

    def close(self) -> None:
        self.proc.stdin.close()
        self.proc.wait()
        self.log.close()


def run(models: list[str], backends: list[str], prompts: int, max_new_tokens: int, repeats: int,
        log=print) -> dict[str, Any]:
    results: dict[str, Any] = {"workload": {"prompts": prompts, "max_new_tokens": max_new_tokens, "repeats": repeats,
                                            "cpus": os.cpu_count(), "loadavg_start": os.getloadavg()[0]}, "runs": []}
    for model in models:
        model_folder(model)  # build once, outside the workers
        names = list(dict.fromkeys(["hf", *backends]))  # hf always: it holds the ceiling and the baseline
        workers = {}
        try:
            for b in names:
                log(f"[bench] {model}: starting {b} ...")
                workers[b] = Worker(model, b, prompts, max_new_tokens)
            calls = [("ceiling", "hf", "ceiling")] + [(b, b, "generate") for b in names]
            rates: dict[str, list[float]] = {c[0]: [] for c in calls}
            for r in range(repeats):
                for key, b, what in calls[r % len(calls):] + calls[:r % len(calls)]:  # rotate the order
                    rates[key].append(workers[b].call(what))
            log(f"[bench] {model}: " + ", ".join(f"{k} {statistics.median(v):.0f}" for k, v in rates.items()))
        finally:
            for w in workers.values():
                w.close()
        ceiling = statistics.median(rates["ceiling"])
        base = statistics.median(rates["hf"])
        params = workers["hf"].info["params"]
        for key in ["ceiling", *names]:
            med = statistics.median(rates[key])
            results["runs"].append({"model": model, "params": params, "backend": key, "tokens_per_s": _stats(rates[key]),
                                    "startup_s": workers[key].info["startup_s"] if key in workers else None,
                                    "ratio_to_hf": med / base, "ratio_to_ceiling": med / ceiling})
    # other jobs on the machine skew the numbers: record how busy it was
    results["workload"]["loadavg_end"] = os.getloadavg()[0]
    return results


def table(results: dict[str, Any]) -> str:
    rows = ["| model | params | engine | tokens/s median (min-max) | x HF | x ceiling | start-up s |",
            "| --- | --- | --- | --- | --- | --- | --- |"]
    for r in results["runs"]:
        t = r["tokens_per_s"]
        name = "ceiling (teacher-forced HF forward)" if r["backend"] == "ceiling" else r["backend"]
        start = f"{r['startup_s']:.1f}" if r["startup_s"] is not None else "-"
        rows.append(f"| {r['model']} | {r['params'] / 1e6:.2f}M | {name} | {t['median']:.0f} ({t['min']:.0f}-{t['max']:.0f}) "
                    f"| {r['ratio_to_hf']:.2f} | {r['ratio_to_ceiling']:.3f} | {start} |")
    return "\n".join(rows)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--backends", default=None, help="comma list of hf, vllm (default: hf,vllm, or hf alone, said in "
                   "one line, when vllm is not installed; naming vllm without it installed is an error); hf always "
                   "runs: it is the baseline and holds the ceiling")
    p.add_argument("--models", default=",".join(MODELS), help="comma list of tiny, small-24m (default both)")
    p.add_argument("--prompts", type=int, default=64, help="prompts per generate call, one sample each")
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--repeats", type=int, default=7, help="timed calls per engine after one warm-up, interleaved")
    p.add_argument("--json", help="write results as JSON here")


def pick_backends(arg: str | None) -> list[str]:
    """--backends as a list; left unset: every backend, or hf alone (said in one line) without vllm."""
    from dataplane_rl.rollout.vllm_engine import INSTALL_HINT, vllm_installed

    if arg is not None:
        return [b for b in arg.split(",") if b]
    if vllm_installed():
        return list(BACKENDS)
    print(f"bench generate: vllm is not installed, so only hf runs ({INSTALL_HINT})", file=sys.stderr)
    return ["hf"]


def run_args(args) -> int:
    if getattr(args, "serve", None):  # the worker side of run()
        model, backend = args.serve.split(":")
        serve(model, backend, args.prompts, args.max_new_tokens)
        return 0
    from dataplane_rl.rollout.vllm_engine import INSTALL_HINT, vllm_installed

    models = [m for m in args.models.split(",") if m]
    backends = pick_backends(args.backends)
    for name, got, valid in (("model", models, MODELS), ("backend", backends, BACKENDS)):
        bad = [x for x in got if x not in valid]
        if bad:
            print(f"error: unknown {name} {bad}; use {', '.join(valid)}", file=sys.stderr)
            return 2
    if "vllm" in backends and not vllm_installed():  # refused here, not as a worker's nested traceback
        print(f"error: --backends {args.backends}: vllm is not installed; {INSTALL_HINT}", file=sys.stderr)
        return 2
    res = run(models, backends, args.prompts, args.max_new_tokens, args.repeats,
              log=lambda s: print(s, file=sys.stderr, flush=True))
    print(table(res))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(res, f, indent=2)
    return 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="generate_throughput", description=__doc__.splitlines()[0])
    add_arguments(p)
    p.add_argument("--serve", help=argparse.SUPPRESS)
    return run_args(p.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
