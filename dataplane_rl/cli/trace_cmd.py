"""`dataplane-rl trace RUN_DIR [--png OUT] [--steps A-B] [--json]`: where a run's time went, from its trace.json."""

from __future__ import annotations

import json
from pathlib import Path

from dataplane_rl.errors import ConfigError


def add_parser(sub) -> None:
    p = sub.add_parser("trace", help="seconds per process and phase from a run's trace.json, and its timeline as a PNG")
    p.add_argument("run_dir", metavar="RUN_DIR", help="a run folder (or its trace.json)")
    p.add_argument("--png", metavar="OUT", help="also draw the timeline: one lane per process, one colour per phase")
    p.add_argument("--steps", metavar="A-B", help="the picture's window: steps A to B (default: every step)")
    p.add_argument("--json", action="store_true", help="print the table as JSON lines")
    p.set_defaults(func=run)


def run(args) -> int:
    from dataplane_rl.run.trace_plot import phase_table, save_timeline_png

    from dataplane_rl.store.targets import check_target, writing

    out = check_target(args.png, "trace --png") if args.png else None  # before anything is read or printed
    path = Path(args.run_dir)
    path = path / "trace.json" if path.is_dir() else path
    if not path.is_file():
        raise ConfigError(f"{path}: no trace.json; runs write one unless logger.trace_max_events=0 (docs/trace.md)")
    steps = None
    if args.steps:
        a, _, b = args.steps.partition("-")
        if not (a.isdigit() and (b or a).isdigit()):
            raise ConfigError(f"--steps {args.steps}: expected A-B (step numbers), e.g. --steps 2-3")
        steps = (int(a), int(b or a))
    rows = phase_table(path)
    if args.json:
        print("\n".join(json.dumps(r) for r in rows))
    else:
        print(f"{'process':<14} {'phase':<20} {'count':>6} {'seconds':>10} {'max_s':>9}")
        for r in rows:
            print(f"{r['process']:<14} {r['phase']:<20} {r['count']:>6} {r['seconds']:>10.3f} {r['max_s']:>9.3f}")
    if out is not None:
        with writing(args.png, "trace --png"):
            save_timeline_png(path, out, steps)
    return 0
