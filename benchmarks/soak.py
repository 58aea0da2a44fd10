"""Soak: N steps with the data plane on, sampling what could leak. Not in CI.

    python benchmarks/soak.py --steps 1000 --backend shm:// --out soak-shm.jsonl
    python benchmarks/soak.py --steps 300 --backend mooncake:// --out soak-mooncake.jsonl

It runs `dataplane-rl train` (the default config plus the overrides given) as a child and, every
--interval seconds, records the RSS and open fds of the driver and of every process under it (Ray's
actors, raylet, gcs_server, Mooncake's master and holders), and the bytes and files of the run's store
folder (shm). At the end it prints, per figure, the first sample after warm-up against the last; a
figure that grows past the tolerance is reported as GROWS and the exit status is 1.

An `shm://` run is given a folder of its own (`shm:///dev/shm/dataplane-rl-soak-<pid>`) so its bytes
can be found among other runs' stores; the script removes it at the end. A `mooncake://` store has no
folder: its holders' RSS is the figure to watch.
"""

from __future__ import annotations

import argparse
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

import psutil

# growth allowed between the first sample after warm-up and the last: allocator noise and lazily
# imported modules, not a leak (a leak of one object per step shows as hundreds of MB over 1000 steps)
TOLERANCE = {"rss_mb": (0.10, 20.0), "fds": (0.0, 4), "store_mb": (0.10, 2.0), "store_files": (0.0, 8)}


def label(p: psutil.Process, driver: int) -> str:
    cmd = p.cmdline()
    if p.pid == driver:  # the command: a local run's supervisor, whose child in a session of its own is the driver
        return "command"
    if "dataplane_rl.cli.main" in cmd:
        return "driver"
    head = cmd[0] if cmd else p.name()
    if head.startswith("ray::"):  # Ray sets an actor's title to ray::Class.method while it runs one
        return head.split()[0].split(".")[0]
    text = " ".join(cmd)
    for name in ("gcs_server", "raylet", "mooncake_master", "holder", "dashboard", "runtime_env", "log_monitor"):
        if name in text:
            return name
    return os.path.basename(head)[:32]


def processes(driver: psutil.Process) -> dict[str, dict]:
    out = {}
    try:
        procs = [driver, *driver.children(recursive=True)]
    except psutil.NoSuchProcess:
        return out
    for p in procs:
        try:
            with p.oneshot():
                out[f"{label(p, driver.pid)}:{p.pid}"] = {"rss_mb": p.memory_info().rss / 2**20, "fds": p.num_fds()}
        except psutil.Error:
            pass  # gone between the listing and the read
    return out


def store_usage(folder: Path | None) -> dict:
    if folder is None or not folder.is_dir():
        return {}
    files = size = 0
    for root, _, names in os.walk(folder):
        for n in names:
            try:
                st = os.lstat(os.path.join(root, n))
            except OSError:
                continue
            files += 1
            size += st.st_blocks * 512  # what the tmpfs holds, not the apparent size
    return {"store_mb": size / 2**20, "store_files": files}


def steps_done(run_dir: Path) -> int:
    f = run_dir / "metrics.jsonl"
    return f.read_text().count("\n") if f.is_file() else 0


def compare(samples: list[dict], warmup: int, steps: int) -> list[tuple]:
    """(series, figure, first after warm-up, last, grows) for every figure sampled both then and at the
    end of the step loop (the final export and shutdown are not steady state)."""
    after = [s for s in samples if warmup <= s["step"] < steps]
    if len(after) < 2:
        return []
    first, last = after[0], after[-1]
    rows = []
    for series in sorted(set(first["figures"]) & set(last["figures"])):
        for fig, a in first["figures"][series].items():
            b = last["figures"][series][fig]
            rel, absolute = TOLERANCE[fig]
            rows.append((series, fig, a, b, b - a > max(absolute, rel * a)))
    return rows


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=1000)
    ap.add_argument("--backend", default="shm://", help="shm:// or mooncake:// (a local one)")
    ap.add_argument("--interval", type=float, default=5.0, help="seconds between samples")
    ap.add_argument("--warmup", type=int, default=0, help="steps before the first compared sample (default: 10%%)")
    ap.add_argument("--out", help="JSON lines of every sample")
    ap.add_argument("--max-seconds", type=float, default=0, help="stop the run (SIGTERM to its process group) "
                    "after this long and report the steps done so far (default: no limit)")
    ap.add_argument("--run-dir", help="the run folder (default: a temporary one, removed)")
    ap.add_argument("overrides", nargs="*", metavar="key=value")
    args = ap.parse_args(argv)
    if args.steps < 1 or args.interval <= 0:
        ap.error("--steps must be >= 1 and --interval > 0")
    warmup = args.warmup or max(1, args.steps // 10)
    tmp = tempfile.mkdtemp(prefix="soak-")
    run_dir = Path(args.run_dir or os.path.join(tmp, "run"))
    folder = None
    backend = args.backend
    if backend.rstrip("/") == "shm:":
        folder = Path(f"/dev/shm/dataplane-rl-soak-{os.getpid()}")
        backend = f"shm://{folder}"
    cmd = [sys.executable, "-m", "dataplane_rl.cli.main", "train", f"grpo.max_num_steps={args.steps}",
           "data_plane.enabled=true", f"data_plane.backend={backend}", f"logger.run_dir={run_dir}",
           "logger.progress=false", *args.overrides]
    log = open(os.path.join(tmp, "train.log"), "w")
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    driver = psutil.Process(proc.pid)
    out = open(args.out, "w") if args.out else None
    samples = []
    t0 = time.monotonic()
    stopped = False
    try:
        while proc.poll() is None:
            if args.max_seconds and time.monotonic() - t0 > args.max_seconds and not stopped:
                os.killpg(proc.pid, signal.SIGTERM)  # as `timeout` or a scheduler would
                stopped = True
            figures = processes(driver)
            usage = store_usage(folder)
            s = {"t": round(time.monotonic() - t0, 1), "step": steps_done(run_dir), "load": os.getloadavg()[0],
                 "figures": {**figures, **({"store": usage} if usage else {})}}
            samples.append(s)
            if out:
                out.write(json.dumps(s) + "\n")
                out.flush()
            time.sleep(args.interval)
    except KeyboardInterrupt:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(timeout=60)
    finally:
        log.close()
        if out:
            out.close()
    tail = Path(tmp, "train.log").read_text()[-2000:]
    if folder is not None:
        shutil.rmtree(folder, ignore_errors=True)
    if args.run_dir is None:
        shutil.rmtree(tmp, ignore_errors=True)
    failed = proc.returncode != 0 and not (stopped and proc.returncode == 128 + signal.SIGTERM)
    if failed:  # the samples taken still say whether anything grew
        print(f"the run failed (exit {proc.returncode}):\n{tail}", file=sys.stderr)
    rows = compare(samples, warmup, args.steps)
    last_step = max((s["step"] for s in samples), default=0)
    print(f"{len(samples)} samples over {samples[-1]['t'] if samples else 0:.0f} s, steps {warmup}..{last_step} "
          f"of {args.steps}{' (stopped by --max-seconds)' if stopped else ''}, "
          f"load average median {statistics.median(s['load'] for s in samples):.1f}" if samples else "no samples")
    print("| process or store | figure | first after warm-up | last | |\n| --- | --- | --- | --- | --- |")
    for series, fig, a, b, grows in rows:
        print(f"| {series} | {fig} | {a:.1f} | {b:.1f} | {'GROWS' if grows else 'flat'} |")
    return 2 if failed else 1 if any(r[4] for r in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
