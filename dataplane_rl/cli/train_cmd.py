"""`dataplane-rl train [--config F | --resume RUN_DIR] [k=v ...]`: GRPO on the embedded tiny config by default."""

from __future__ import annotations

import json
import os
import sys


def add_parser(sub) -> None:
    p = sub.add_parser("train", help="run GRPO (default: the embedded tiny config, no download)")
    p.add_argument("--config", help="YAML config (default: the embedded configs/grpo_tiny.yaml)")
    p.add_argument("--resume", metavar="RUN_DIR", help="continue RUN_DIR from its latest complete checkpoint, "
                   "with its config.yaml plus the overrides (those that change the numbers are refused)")
    p.add_argument("--accept-mismatch", action="store_true", help="with --resume: continue from the checkpoint even "
                   "if another run saved it, or task.path / task.val_path changed since (refused otherwise: the "
                   "resumed steps would not be this run's)")
    p.add_argument("overrides", nargs="*", metavar="key=value", help="e.g. data_plane.enabled=true grpo.max_num_steps=5")
    p.set_defaults(func=run)


def run(args) -> int:
    from dataplane_rl.config import load_config
    from dataplane_rl.errors import ConfigError

    if args.resume and args.config:
        raise ConfigError("--resume uses the run's own config.yaml; drop --config and pass changes as key=value")
    if args.accept_mismatch and not args.resume:
        raise ConfigError("--accept-mismatch applies to --resume RUN_DIR only; drop it for a new run")
    if args.resume:
        from dataplane_rl.checkpoint.resume import resume_config

        cfg = resume_config(args.resume, args.overrides)
    else:
        cfg = load_config(args.config, args.overrides)  # fails here, before anything starts, on a bad key
    if args.from_command_line:
        from dataplane_rl.run.private_ray import reexec

        reexec(cfg, sys.argv[1:])  # once, with the environment of a private local Ray (returns on a cluster)
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()  # one progress bar: ours
    from dataplane_rl.driver.loop import train
    from dataplane_rl.run.reaper import owns_descendants

    with owns_descendants():  # this process is the run: nothing it started outlives it
        summary = train(cfg, resume=bool(args.resume), accept_mismatch=args.accept_mismatch)
    # stdout holds only this line (progress and logs go to stderr), so `dataplane-rl train ... | jq` works
    print(json.dumps({k: summary.get(k) for k in ("status", "steps_completed", "reward_first_quarter",
                                                  "reward_last_quarter", "final_validation_reward", "run_dir",
                                                  "plot")}))
    code = 128 + summary["signal"] if summary["status"] == "interrupted" else 0  # the shell's code for a signal
    from dataplane_rl.run.preempt import LOST

    if LOST.is_set():  # Ray's core worker, its raylet gone, crashes (SIGSEGV) in its destructors at exit
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    return code
