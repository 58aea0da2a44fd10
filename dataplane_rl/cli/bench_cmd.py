"""`dataplane-rl bench store|e2e|generate|train`: the benchmarks in benchmarks/, from the installed package.

Each benchmark module has add_arguments(parser) and run_args(args); the scripts in benchmarks/ call
the same modules, so both entry points take the same options.
"""

from __future__ import annotations

import importlib

BENCHES = {
    "store": ("dataplane_rl.bench.store", "column-store GB/s vs the memcpy ceiling and raw Mooncake"),
    "e2e": ("dataplane_rl.bench.e2e", "GRPO step time and the data plane's share, off vs shm vs Mooncake"),
    "generate": ("dataplane_rl.bench.generate", "Hugging Face vs vLLM generation tokens/s"),
    "train": ("dataplane_rl.bench.train", "train tokens/s: padded vs dynamic batching vs sequence packing"),
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
        b.set_defaults(func=mod.run_args)
