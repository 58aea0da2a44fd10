"""`dataplane-rl export RUN_DIR [--step N] OUT`: a run's checkpoint as a Hugging Face model folder."""

from __future__ import annotations

import json
import sys
from pathlib import Path

from dataplane_rl.errors import ConfigError


def add_parser(sub) -> None:
    p = sub.add_parser("export", help="write a run's checkpoint as a Hugging Face folder (config, safetensors, tokenizer)")
    p.add_argument("run_dir", metavar="RUN_DIR", help="a training run's folder (with checkpoints/)")
    p.add_argument("out", metavar="OUT", help="new folder for the model; from_pretrained(OUT) loads it")
    p.add_argument("--step", type=int, help="checkpoint step (default: the latest complete one)")
    p.set_defaults(func=run)


def run(args) -> int:
    from dataplane_rl.store.targets import check_target

    out = Path(args.out)
    check_target(out, "export OUT", folder=True)
    if out.exists() and not out.is_dir():
        raise ConfigError(f"export target {out} is a file, not a folder; pass a new folder")
    if out.exists() and any(out.iterdir()):
        raise ConfigError(f"export target {out} exists and is not empty; pass a new folder")
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()  # save_pretrained's "Writing model shards" bar, for one small file
    from dataplane_rl.checkpoint.export import export_run

    path, step = export_run(args.run_dir, out, args.step)
    print(json.dumps({"out": str(path), "step": step}), file=sys.stderr)
    return 0
