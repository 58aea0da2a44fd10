"""`dataplane-rl bench store|e2e|generate|train|peers`: the benchmarks in benchmarks/, from the installed package.

Each benchmark module has add_arguments(parser) and run_args(args); the scripts in benchmarks/ call
the same modules, so both entry points take the same options.
"""

from __future__ import annotations

import importlib

BENCHES = {
    "store": ("dataplane_rl.bench.store",
              "column-store GB/s vs the memcpy ceiling, the shm and Mooncake floors and raw Mooncake"),
    "e2e": ("dataplane_rl.bench.e2e", "GRPO step time and the data plane's share, off vs shm vs Mooncake"),
    "generate": ("dataplane_rl.bench.generate", "Hugging Face vs vLLM generation tokens/s"),
    "train": ("dataplane_rl.bench.train", "train tokens/s: padded vs dynamic batching vs sequence packing"),
    "peers": ("dataplane_rl.bench.peers", "the same GRPO run in TRL's GRPOTrainer and dataplane-rl: s/step, samples/s, "
              "peak memory"),
}


def add_parser(sub) -> None:
    p = sub.add_parser("bench", help="measure store throughput, step time, generation throughput")
    bsub = p.add_subparsers(dest="bench_command", required=True, metavar="BENCH")
    for name, (module, help_) in BENCHES.items():
        try:
            mod = importlib.import_module(module)
        except ModuleNotFoundError as e:
            if e.name == module:
                continue
            raise
        b = bsub.add_parser(name, help=help_)
        mod.add_arguments(b)
        b.set_defaults(func=_with_json_target(mod.run_args))


def _with_json_target(run_args):
    """run_args with its --json FILE (and --plot) checked before the benchmark runs (not inside a store folder,
    a file of the user's own: store/targets.py), --json written under a temporary name and renamed at the end."""

    def run(args) -> int:
        from dataplane_rl.store.targets import check_target, writing

        if getattr(args, "plot", None):
            check_target(args.plot, f"bench {args.bench_command} --plot")
        out = getattr(args, "json", None)
        if not out:
            return run_args(args)
        import os

        what = f"bench {args.bench_command} --json"
        final = check_target(out, what)
        tmp = final.with_name(f".{final.name}.{os.getpid()}.tmp")
        args.json = str(tmp)
        try:
            rc = run_args(args)
            if tmp.exists():
                with writing(out, what):
                    os.replace(tmp, final)
        finally:
            args.json = out
            tmp.unlink(missing_ok=True)
        return rc

    return run
