"""Preemption by a SIGTERM to the whole process group (`timeout`, `kill -- -PGID`, scancel, a pod stop).
The group holds only the supervisor (run/supervise.py): the driver and Ray's processes are in a session
of their own, so the driver alone gets the signal, from the supervisor, and stops the run itself with Ray
still up. The run must stop within SLURM's default grace period (30 s), exit 143, say `interrupted`
(`"error": "SIGTERM"`, not the lost-Ray fallback of run/preempt.py) in summary.json, save the
interrupted step's checkpoint, leave no process of its group and no store folder, and leave its latest
complete checkpoint resumable. Two moments: during a step (a SIGHUP, a closed terminal, which stops a run as
SIGTERM does), and during a checkpoint save (the one then resumed). Every kill must stop cleanly: no retry."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from test_shutdown import Tree, wait_for
from test_train_e2e import SMALL, overriding

from dataplane_rl.checkpoint.manager import CheckpointManager, step_of

GRACE_S = 30  # SLURM's default KillWait: after it, the job gets SIGKILL
RUN = overriding(SMALL, "grpo.max_num_steps=100", "data_plane.enabled=true", "checkpointing.enabled=true",
                "checkpointing.save_period=1", "checkpointing.keep_top_k=2", "grpo.val_period=0")


def group_members(pgid: int) -> list[str]:
    out = []
    for p in psutil.process_iter(["pid", "name"]):
        try:
            if os.getpgid(p.pid) == pgid and p.status() != psutil.STATUS_ZOMBIE:
                out.append(f"{p.pid} {p.info['name']}")
        except (ProcessLookupError, psutil.Error):
            pass
    return out


def saving(run_dir: Path) -> bool:
    root = run_dir / "checkpoints"
    return root.is_dir() and any(p.name.startswith(".step_") for p in root.iterdir())


@pytest.mark.parametrize(("moment", "sig"), [("step", signal.SIGHUP), ("checkpoint-save", signal.SIGTERM)],
                         ids=["step-SIGHUP", "checkpoint-save-SIGTERM"])
def test_a_group_stop_signal_stops_cleanly(tmp_path, moment, sig):
    """A closed terminal or ssh session (SIGHUP to the job's group) once ended a run in 0.3 s with exit 129, no
    summary.json, no checkpoint, an orphaned shm store and token folder: it stops as SIGTERM does. The
    SIGTERM goes to a job that inherited SIGINT ignored (`nohup`, `&`), which must not change how it stops."""
    run_dir = tmp_path / "run"
    returncode, out = group_kill(run_dir, moment, sig, sigint_ignored=sig == signal.SIGTERM)
    assert returncode == 128 + sig, out[-3000:]
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["status"] == "interrupted" and summary["signal"] == sig, summary
    # the driver's own stop: the step it was in finished and was saved, with Ray up (the lost-Ray fallback
    # says "SIGTERM to the process group: Ray's processes stopped with the driver" and saves nothing)
    assert summary["error"] == signal.Signals(sig).name, summary
    assert step_of(CheckpointManager(run_dir / "checkpoints").find()) == summary["steps_completed"], summary
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    assert summary["steps_completed"] == len(lines) >= 1
    for line in lines:
        json.loads(line)  # every line whole
    assert len(list((run_dir / "train_data").glob("step_*.jsonl"))) == len(lines)
    assert not list(run_dir.rglob("*.tmp*")), "a file half-written when the signal came"
    store = summary["store_url"]
    assert store.startswith("shm:///"), summary
    assert not Path(store[len("shm://"):].partition("?")[0]).exists(), f"{store} outlived the run"
    latest = CheckpointManager(run_dir / "checkpoints").find()
    if moment == "checkpoint-save":  # the last complete checkpoint resumes: one more step from it
        resumed = subprocess.run([sys.executable, "-m", "dataplane_rl.cli.main", "train", "--resume", str(run_dir),
                                  f"grpo.max_num_steps={step_of(latest) + 1}"],
                                 capture_output=True, text=True, timeout=600)
        assert resumed.returncode == 0, resumed.stderr[-3000:]
        assert json.loads((run_dir / "summary.json").read_text())["status"] == "completed"


def test_group_sigterm_while_ray_starts_stops_as_interrupted(tmp_path):
    """A SIGTERM while ray.init ran ended the run "failed" with exit 15 (Ray's own handler, sys.exit(15)), and just
    after it with exit 134 and a C++ stack (the core worker's failure handler), no summary.json. The run's handler
    stays in place through ray.init, and a stop signal while the run starts abandons the start at once: exit 143,
    summary "interrupted", no step run, nothing left behind."""
    run_dir = tmp_path / "run"
    returncode, out = group_kill(run_dir, "ray-init")
    assert returncode == 128 + signal.SIGTERM, out[-3000:]
    summary = json.loads((run_dir / "summary.json").read_text())
    assert (summary["status"], summary["signal"], summary["error"], summary["steps_completed"]) == \
        ("interrupted", signal.SIGTERM, "SIGTERM", 0), summary
    assert "Traceback" not in out, out[-3000:]


def group_kill(run_dir: Path, moment: str, sig: int = signal.SIGTERM, sigint_ignored: bool = False) -> tuple[int, str]:
    """Start a run in its own process group, send the whole group `sig` at `moment`; (exit status, output).
    sigint_ignored: the job inherits SIGINT ignored, as one started with `&` or nohup does. On a clean stop it
    also checks that no process of the run or its group outlived it."""
    cmd = [sys.executable, "-m", "dataplane_rl.cli.main", "train", *RUN, f"logger.run_dir={run_dir}"]
    # a job in a terminal or a scheduler gets SIGHUP's default action; one started under nohup (a CI runner may
    # be) inherits it ignored, which the run keeps ignored on purpose (run/preempt.py): give the job the default
    def dispositions() -> None:
        signal.signal(signal.SIGHUP, signal.SIG_DFL)
        signal.signal(signal.SIGINT, signal.SIG_IGN if sigint_ignored else signal.SIG_DFL)

    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env=dict(os.environ, PYTHONUNBUFFERED="1"), start_new_session=True,
                            preexec_fn=dispositions)
    pgid = proc.pid  # start_new_session: the child leads a group of its own, as a batch job does
    tree = Tree(psutil.Process(proc.pid))
    try:
        if moment == "step":  # step 1 is saved: step 2 is under way
            wait_for("first checkpoint", lambda: (run_dir / "checkpoints" / "step_000001").is_dir(), proc, tree)
        elif moment == "ray-init":  # gcs_server is up: ray.init goes on to start the raylet and wait for it
            wait_for("Ray's gcs_server", lambda: any("gcs_server" in cmd for _, cmd in tree.seen.values()), proc, tree)
        else:  # a save after a complete one: that one must stay the resumable latest
            wait_for("second checkpoint save in progress",
                     lambda: (run_dir / "checkpoints" / "step_000001").is_dir() and saving(run_dir), proc, tree)
        tree.poll()
        os.killpg(pgid, sig)
        sent = time.monotonic()
        while proc.poll() is None:
            tree.poll()
            assert time.monotonic() - sent < GRACE_S, f"the run did not exit within {GRACE_S} s of the group {sig!r}"
            time.sleep(0.05)
        out = proc.stdout.read()
        print(f"{moment}: exit {proc.returncode} {time.monotonic() - sent:.1f} s after the group {sig!r}")
        if proc.returncode != 128 + sig:
            return proc.returncode, out
        deadline = time.monotonic() + 10  # SIGTERMed processes may take a moment to go
        while (tree.alive() or group_members(pgid)) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert not tree.alive(), "processes of the run outlived it:\n" + "\n".join(tree.alive())
        assert not group_members(pgid), f"processes of group {pgid} outlived the run: {group_members(pgid)}"
    finally:
        if proc.poll() is None:
            proc.kill()
        tree.kill_all()
    return proc.returncode, out
