"""`dataplane-rl bench train`: train tokens/s of padded microbatches, dynamic batching and sequence packing on
the same rows (one process, one rank, the ~24.5M bench model), with a long-tail RL length spread (16-1024).

Each timed repeat is one optimizer step's forwards and backwards (train/worker.py `train_microbatches`, the
code a train worker runs) over all rows; modes alternate within every repeat so machine load hits them alike.
Reported: median tokens/s (valid tokens / second), the padding fraction of the slots computed, the ratio to
padded, and the ideal ratio 1 / (1 - padded padding fraction) that removing all padding would give.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

import numpy as np

MODES = ("padded", "dynamic", "packed", "packed_sdpa")


def long_tail_lengths(n: int, seed: int = 0, lo: int = 16, hi: int = 1024) -> np.ndarray:
    """Row lengths with RL's long tail: lognormal around ~120 tokens, clipped to [lo, hi]."""
    rng = np.random.default_rng(seed)
    return np.clip(np.round(rng.lognormal(np.log(120), 1.0, n)), lo, hi).astype(np.int64)


def synthetic_table(lengths: np.ndarray, vocab: int, seed: int = 0, prompt: int = 8):
    """A table of the train fields for rows of these lengths: random tokens, the first `prompt` tokens masked out,
    a few masked samples, random advantages, rewards and old/reference/generation log-probs near the policy's."""
    import pyarrow as pa

    from dataplane_rl.store import list_array

    rng = np.random.default_rng(seed)
    n, total = len(lengths), int(lengths.sum())
    mask = np.concatenate([(np.arange(k) >= min(prompt, k - 1)).astype(np.int8) for k in lengths])
    lp = lambda: (-rng.random(total) * 4.0 - 0.5).astype(np.float32)  # noqa: E731
    return pa.table({
        "input_ids": list_array(rng.integers(3, vocab, total).astype(np.int32), lengths, pa.int32()),
        "input_lengths": pa.array(lengths.astype(np.int32)),
        "token_mask": list_array(mask, lengths, pa.int8()),
        "generation_logprobs": list_array(lp(), lengths, pa.float32()),
        "prev_logprobs": list_array(lp(), lengths, pa.float32()),
        "reference_policy_logprobs": list_array(lp(), lengths, pa.float32()),
        "total_reward": pa.array(rng.integers(0, 2, n).astype(np.float32)),
        "advantages": pa.array(rng.normal(size=n).astype(np.float32)),
        "sample_mask": pa.array((rng.random(n) > 0.1).astype(np.int8)),
    })


def policy_for(mode: str, micro: int, budget: int):
    from dataplane_rl.config import PolicyConfig

    on = {"enabled": True, "train_mb_tokens": budget, "logprob_mb_tokens": budget}
    return PolicyConfig(train_micro_batch_size=micro,
                        dynamic_batching=on if mode == "dynamic" else {},
                        sequence_packing=on if mode.startswith("packed") else {})


def step(model, batch, policy, loss_fn) -> tuple[float, float, int]:
    """One optimizer step's forwards and backwards: (seconds, padding fraction, valid tokens)."""
    from dataplane_rl.train.batch import plan_microbatches
    from dataplane_rl.train.counts import local_counts
    from dataplane_rl.train.worker import train_microbatches

    import torch

    model.zero_grad(set_to_none=True)
    sync = torch.cuda.synchronize if batch["input_ids"].is_cuda else (lambda: None)
    sync()
    t0 = time.perf_counter()
    mbs = plan_microbatches(batch, policy, "train")
    _, used = train_microbatches(model, loss_fn, mbs, local_counts(batch), 1.0)
    sync()
    return time.perf_counter() - t0, float(1 - used[0] / used[1]), int(used[0])


def measure(rows: int, repeats: int, micro: int, budget: int, modes: tuple[str, ...], seed: int = 0,
            model_name: str = "small-24m", device: str = "auto") -> dict:
    import torch

    from dataplane_rl.algorithms.loss import ClippedPGLoss
    from dataplane_rl.bench.generate import model_folder
    from dataplane_rl.schema import load_schema
    from dataplane_rl.train.batch import build_train_batch
    from dataplane_rl.model.load import load_model, pick_device
    from dataplane_rl.model.logprobs import packed_attention

    device = pick_device(device)
    torch.manual_seed(seed)
    models = {}
    for mode in modes:
        m = load_model(model_folder(model_name, seed), device).train()
        if mode.startswith("packed"):
            packed_attention(m, device, "sdpa" if mode == "packed_sdpa" else "auto")
        models[mode] = m
    lengths = long_tail_lengths(rows, seed)
    table = synthetic_table(lengths, models[modes[0]].config.vocab_size, seed)
    batch = build_train_batch(table, load_schema("grpo"), device)
    loss_fn = ClippedPGLoss()
    times: dict[str, list[float]] = {m: [] for m in modes}
    pad: dict[str, float] = {}
    for r in range(repeats + 1):  # the first round warms up
        for mode in modes:
            s, pf, toks = step(models[mode], batch, policy_for(mode, micro, budget), loss_fn)
            pad[mode] = pf
            if r:
                times[mode].append(s)
            print(f"  {mode:<12} repeat {r}: {s:.2f}s", file=sys.stderr)
    out = {"rows": rows, "lengths": {"mean": float(lengths.mean()), "max": int(lengths.max()), "min": int(lengths.min())},
           "micro": micro, "budget": budget, "modes": {}}
    base = toks / statistics.median(times[modes[0]])
    for mode in modes:
        tps = toks / statistics.median(times[mode])
        out["modes"][mode] = {"tokens_per_s": tps, "padding_fraction": pad[mode], "ratio_to_padded": tps / base,
                              "step_s_median": statistics.median(times[mode])}
    out["ideal_ratio"] = 1.0 / (1.0 - pad[modes[0]])
    return out


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--rows", type=int, default=32, help="rows per optimizer step (long-tail lengths 16-1024)")
    p.add_argument("--repeats", type=int, default=3, help="timed steps per mode after one warm-up, interleaved")
    p.add_argument("--micro", type=int, default=8, help="padded: rows per microbatch (policy.train_micro_batch_size)")
    p.add_argument("--budget", type=int, default=4096, help="dynamic and packed: *_mb_tokens")
    p.add_argument("--modes", default=",".join(MODES), help=f"comma list of {', '.join(MODES)}; the first is the base")
    p.add_argument("--model", default="small-24m", help="small-24m (default) or tiny")
    p.add_argument("--device", default="auto", help="auto (CUDA when available), cpu or cuda")
    p.add_argument("--json", help="write results as JSON here")


def run_args(args) -> int:
    import os

    out = measure(args.rows, args.repeats, args.micro, args.budget, tuple(m for m in args.modes.split(",") if m),
                  model_name=args.model, device=args.device)
    out["device"] = args.device
    out["load"] = os.getloadavg()[0]
    print(f"{'mode':<12} {'tokens/s':>10} {'padding':>8} {'x padded':>9}   ideal {out['ideal_ratio']:.2f}x, "
          f"load {out['load']:.1f}")
    for mode, r in out["modes"].items():
        print(f"{mode:<12} {r['tokens_per_s']:>10.0f} {r['padding_fraction']:>8.2f} {r['ratio_to_padded']:>9.2f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=2)
    return 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_arguments(p)
    return run_args(p.parse_args(argv))


if __name__ == "__main__":
    raise SystemExit(main())
