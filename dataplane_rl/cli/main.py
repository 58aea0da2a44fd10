"""`dataplane-rl`: train, inspect schemas, configs and live stores, benchmark.

Each command lives in its own module with `add_parser(subparsers)`; heavy imports happen inside the
command so `dataplane-rl --help` stays fast. Only the standard library is imported before `main` runs: every
other import (the command modules, the benchmarks' numpy and pyarrow) happens inside its Ctrl-C guard, so a
Ctrl-C in the first second prints `interrupted`, not a traceback.
"""

from __future__ import annotations

import argparse
import importlib
import os
import signal
import sys

# module name -> its add_parser registers one top-level command
COMMANDS = ("train_cmd", "export_cmd", "schema_cmd", "config_cmd", "store_cmd", "bench_cmd", "trace_cmd")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="dataplane-rl",
        description="A columnar data plane for RL post-training, with a GRPO pipeline on top.",
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name in COMMANDS:
        try:
            module = importlib.import_module(f"dataplane_rl.cli.{name}")
        except ModuleNotFoundError as e:
            if e.name == f"dataplane_rl.cli.{name}":
                continue  # command not built yet
            raise
        module.add_parser(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    try:
        return _run(argv)
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130


def _run(argv: list[str] | None) -> int:
    from dataplane_rl.errors import DataPlaneError, crossed_ray, one_line, unwrap

    parser = build_parser()
    args = parser.parse_args(argv)
    args.from_command_line = argv is None or list(argv) == sys.argv[1:]  # this process is the command: it may re-exec
    try:
        if getattr(args, "overrides", None):  # a key given twice would silently take the last
            from dataplane_rl.config.load import check_overrides

            check_overrides(args.overrides)
        rc = int(args.func(args) or 0)
        sys.stdout.flush()  # here, where a closed pipe is caught, not at interpreter exit
        return rc
    except BrokenPipeError:
        # the reader went away (`dataplane-rl schema show --json | head`): stop quietly, as `cat` does. Point
        # stdout at /dev/null so the interpreter's final flush does not raise the same error again
        # (the recipe of Python's signal docs, "Note on SIGPIPE").
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 128 + signal.SIGPIPE
    except Exception as e:
        # ours, anything that crossed Ray (a RayTaskError, an actor's death, a cancelled task), or anything a run
        # wrote to its error.log: one line, no wrapper text, colour codes or remote traceback
        line = getattr(e, "run_error", None)  # RunDir.record_error's: what summary.json says, error.log named
        if not (line or isinstance(e, DataPlaneError) or crossed_ray(e)):
            raise  # a bug of ours outside a run: its traceback is what is useful
        print(f"error: {line or one_line(e)}", file=sys.stderr)
        return 2 if isinstance(unwrap(e), DataPlaneError) else 1


if __name__ == "__main__":
    sys.exit(main())
