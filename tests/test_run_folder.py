"""The run folder policy (docs/run-folder.md): fresh folders, one live run per folder, nothing of an
earlier run lost to a run that fails before it starts, and a summary for every failure."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from dataplane_rl.config import load_config
from dataplane_rl.errors import ConfigError
from dataplane_rl.run.folder import RunDir

ROOT = Path(__file__).resolve().parents[1]

QUICK = ["logger.progress=false", "grpo.max_num_steps=1"]


def previous_run(folder: Path) -> dict[str, bytes]:
    """A finished run's files, as an earlier run would have left them; returns their bytes."""
    (folder / "train_data").mkdir(parents=True)
    (folder / "config.yaml").write_text("grpo: {}\n")
    (folder / "metrics.jsonl").write_text('{"step": 1, "train/reward": 0.5}\n')
    (folder / "summary.json").write_text('{"status": "completed", "steps_completed": 1}\n')
    (folder / "train_data" / "step_000001.jsonl").write_text('{"sample_id": "step-000001/0"}\n')
    return snapshot(folder)


def snapshot(folder: Path) -> dict[str, bytes]:
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*"))
            if p.is_file() and p.name != ".lock"}


def train(*overrides: str):
    from dataplane_rl.driver.loop import train as run_train

    return run_train(load_config(None, [*QUICK, *overrides]))


def test_default_run_dir_is_fresh_per_run_and_latest_follows(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert load_config(None).logger.run_dir is None
    first = RunDir(None)
    second = RunDir(None)  # the same second: mkdir picks -2, never the same folder
    try:
        assert first.path != second.path and first.path.parent == second.path.parent == Path("runs")
        assert second.path.name.startswith(first.path.name)
        assert not os.path.lexists("runs/latest"), "runs/latest moved before a run started"
        second.begin("grpo: {}\n")  # the run has started: now runs/latest names it
        assert os.readlink("runs/latest") == second.path.name
        assert Path("runs/latest").resolve() == second.path.resolve()
    finally:
        first.close()
        second.close()


def test_second_live_run_is_refused_naming_the_holder(tmp_path):
    folder = tmp_path / "run"
    holder = subprocess.Popen(
        [sys.executable, "-c", "import sys, time; from dataplane_rl.run.folder import RunDir; "
                               f"r = RunDir({str(folder)!r}); print('locked', flush=True); sys.stdin.read()"],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "locked", "the holder died before taking the lock"
        (folder / "metrics.jsonl").write_text('{"step": 1}\n')  # what the live run has written so far
        before = snapshot(folder)
        with pytest.raises(ConfigError, match=rf"in use by a live run \(PID {holder.pid}\b"):
            train(f"logger.run_dir={folder}", "logger.overwrite=true")
        assert snapshot(folder) == before, "the refused run touched the live run's folder"
    finally:
        holder.stdin.close()
        holder.wait(timeout=30)
    assert holder.returncode == 0
    RunDir(folder, overwrite=True).close()  # the lock went with its holder


def test_existing_run_is_refused_and_kept(tmp_path):
    folder = tmp_path / "run"
    before = previous_run(folder)
    with pytest.raises(ConfigError, match=rf"{folder} already holds a run.*--resume {folder}.*logger\.overwrite=true"):
        train(f"logger.run_dir={folder}")
    assert snapshot(folder) == before


@pytest.mark.parametrize("bad", ["task.name=nope", "task.name=math_jsonl", "policy.model={tmp}/no-model"],
                         ids=["unknown-task", "missing-task-path", "missing-model"])
def test_failure_before_start_loses_nothing_and_says_why(tmp_path, bad):
    folder = tmp_path / "run"
    before = previous_run(folder)
    bad = bad.format(tmp=tmp_path)
    extra = [f"task.path={tmp_path}/missing.jsonl"] if bad == "task.name=math_jsonl" else []
    with pytest.raises(ConfigError):
        train(f"logger.run_dir={folder}", "logger.overwrite=true", bad, *extra)
    after = snapshot(folder)
    summary = json.loads(after.pop("summary.json"))
    before.pop("summary.json")
    assert after == before, "a run that never started removed the previous run's files"
    assert summary["status"] == "failed" and summary["started"] is False
    assert summary["error"].startswith("ConfigError: ") and summary["steps_completed"] == 0


def test_failure_in_a_fresh_folder_leaves_a_summary_and_the_folder_reusable(tmp_path):
    folder = tmp_path / "run"
    with pytest.raises(ConfigError, match="unknown task.name 'nope'"):
        train(f"logger.run_dir={folder}", "task.name=nope")
    summary = json.loads((folder / "summary.json").read_text())
    assert summary["status"] == "failed" and "unknown task.name 'nope'" in summary["error"]
    RunDir(folder).close()  # nothing to lose there: a corrected run may take the folder


def test_failure_before_start_makes_no_fresh_folder_and_keeps_latest(tmp_path, monkeypatch):
    """With logger.run_dir unset, a run that never started leaves runs/ as it was: its fresh folder goes
    again and runs/latest still names the last run that did start (README follow-ups use it)."""
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ConfigError, match="unknown task.name 'nope'"):
        train("task.name=nope")
    assert not Path("runs").exists()
    (tmp_path / "runs" / "20260101-000000").mkdir(parents=True)
    os.symlink("20260101-000000", "runs/latest")
    with pytest.raises(ConfigError, match="unknown task.name 'nope'"):
        train("task.name=nope")
    assert sorted(os.listdir("runs")) == ["20260101-000000", "latest"]
    assert os.readlink("runs/latest") == "20260101-000000"


def test_lock_file_names_the_live_pid(tmp_path):
    run = RunDir(tmp_path / "r")
    try:
        assert (tmp_path / "r" / ".lock").read_text().strip() == str(os.getpid())
        with pytest.raises(ConfigError, match=f"PID {os.getpid()}"):
            RunDir(tmp_path / "r")  # LOCK_NB: refuses at once instead of waiting
    finally:
        run.close()


def test_resume_and_overwrite_drop_later_step_files_of_both_kinds(tmp_path):
    """train_data/step_N.jsonl and (logger.save_rollouts) rollouts/step_N.parquet: a resume from step 1 drops
    the later steps' files of both kinds (they are run again); an overwrite drops them all. A resume is the same
    run (its id in run.json kept; a folder without one gets one); an overwrite is a new run, and the replaced
    run's checkpoints in RUN_DIR/checkpoints go with it (a --resume of the new run once took the old run's later
    checkpoint for its own), while a folder of a shared checkpointing.checkpoint_dir stays."""
    from dataplane_rl.checkpoint.identity import read_run_id

    folder = tmp_path / "run"
    previous_run(folder)
    (folder / "train_data" / "step_000002.jsonl").write_text("{}\n")
    (folder / "rollouts").mkdir()
    for k in (1, 2):
        (folder / "rollouts" / f"step_00000{k}.parquet").write_bytes(b"PAR1")
    for name in ("step_000001", "step_000002", ".step_000003.tmp", "shared-run-1a2b3c4d/step_000002"):
        (folder / "checkpoints" / name).mkdir(parents=True)
    assert read_run_id(folder) is None  # a folder from before runs had ids
    run = RunDir(folder, resume=True)
    run.resume_from("grpo: {}\n", 1)
    run.close()
    first = read_run_id(folder)
    assert first and first.startswith("run-") and first == run.run_id
    left = sorted(str(p.relative_to(folder)) for p in folder.rglob("step_*"))
    assert left == ["checkpoints/shared-run-1a2b3c4d/step_000002", "checkpoints/step_000001",
                    "checkpoints/step_000002", "rollouts/step_000001.parquet", "train_data/step_000001.jsonl"]
    run = RunDir(folder, resume=True)
    run.resume_from("grpo: {}\n", 1)
    run.close()
    assert read_run_id(folder) == first
    run = RunDir(folder, overwrite=True)
    run.begin("grpo: {}\n")
    run.close()
    assert read_run_id(folder) not in (None, first)
    assert sorted(str(p.relative_to(folder)) for p in folder.rglob("*step_*")) == [
        "checkpoints/shared-run-1a2b3c4d/step_000002"]


def test_a_full_disk_at_the_end_is_one_line_and_leaves_no_tmp(tmp_path, capsys):
    """A full disk once ended a run with a traceback, no summary.json and summary.json.tmp / error.log.tmp
    left. On a small tmpfs (the real disk is never filled): the error's line says why it has no traceback,
    the summary's failure is one line naming the run's own end, nothing half-written is left, and once
    there is room again the summary is written."""
    from test_shm_faults import need_root

    need_root("mounting a tmpfs")
    mnt = tmp_path / "tmpfs"
    mnt.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(mnt)], check=True)
    try:
        run = RunDir(mnt / "run")
        run.begin("grpo: {}\n")
        filler = mnt / "filler"
        with open(filler, "wb") as f:  # fill the tmpfs to its last page
            with pytest.raises(OSError, match="No space left on device"):
                while True:
                    f.write(b"\0" * 65536)
                    f.flush()
        try:
            raise RuntimeError("the run's own failure")
        except RuntimeError as e:
            line = run.record_error(e)
        assert line.startswith("RuntimeError: the run's own failure (no traceback: ") and "No space left" in line
        capsys.readouterr()
        summary = run.finish("failed", line)
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and err[0].startswith(f"error: {mnt / 'run' / 'summary.json'} or reward.png could "
                                                   "not be written: No space left on device; the run ended failed: "
                                                   "RuntimeError: the run's own failure"), err
        assert summary["status"] == "failed" and "No space left" in summary["summary_error"]
        assert not [p.name for p in (mnt / "run").iterdir() if ".tmp" in p.name]
        filler.unlink()
        run.finish("failed", line)
        assert json.loads((mnt / "run" / "summary.json").read_text())["error"] == line
        run.close()
    finally:
        subprocess.run(["umount", "-l", str(mnt)], check=True)


PEAK_MEMORY = """
import json, os, subprocess, sys
from pathlib import Path
from dataplane_rl.run.memory import PeakMemory

code = ("import mmap, sys\\n"
        "f = open(sys.argv[1], 'r+b'); m = mmap.mmap(f.fileno(), 0); m[::4096] = b'x' * (len(m) // 4096)\\n"
        "own = bytearray(64 * 2**20 if sys.argv[2] == 'own' else 0); own[::4096] = b'y' * (len(own) // 4096)\\n"
        "print('ready', flush=True); sys.stdin.read()\\n")
shared = Path("/dev/shm") / f"dataplane-rl-test-{os.getpid()}"
shared.write_bytes(b"\\0" * (64 * 2**20))
kids = [subprocess.Popen([sys.executable, "-c", code, str(shared), kind], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                         text=True) for kind in ("own", "shared-only")]
try:
    for k in kids:
        assert k.stdout.readline() == "ready\\n"
    memory = PeakMemory(lambda: {k.pid: f"child-{i}" for i, k in enumerate(kids)})
    memory.sample()
    both = memory.summary()
    kids[1].stdin.close()
    kids[1].wait(timeout=30)
    memory.sample()  # the exited child is not seen again
    after = memory.summary()
finally:
    for k in kids:
        k.kill()
    shared.unlink()
print(json.dumps({"both": both, "after": after}))
"""


def test_peak_memory_counts_a_shared_page_once_and_keeps_an_exited_process():
    """summary.json's `memory` (run/memory.py): two children map the same 64 MiB of shared memory and one holds
    64 MiB of its own. Their PSS splits the shared pages between them, so one sample's sum counts them once, while
    each one's kernel peak RSS counts them whole. Once one exits the other is their only holder (its PSS takes them
    all); the exited one keeps its peak, and the largest sum of one sample stays the first.
    Measured from a fresh process: the totals are over the sampling process's whole tree, and a pytest worker may
    hold a Ray session of earlier tests whose processes' memory moves between samples."""
    p = subprocess.run([sys.executable, "-c", PEAK_MEMORY], capture_output=True, text=True, timeout=120,
                       env=dict(os.environ, PYTHONPATH=str(ROOT)))
    assert p.returncode == 0, p.stderr[-3000:]
    got = json.loads(p.stdout)
    both, after = got["both"], got["after"]
    rows = {r["role"]: r for r in both["processes"]}
    assert list(rows)[0] == "driver" and both["samples"] == 1 and both["measure"] == "pss"
    own, only = rows["child-0"], rows["child-1"]
    # each child's RSS holds the whole 64 MiB it touched, its PSS half of it (two holders) plus its own memory
    assert only["peak_rss_mb"] > 64 and 30 < only["peak_mb"] < 48, only
    assert own["peak_rss_mb"] > 128 and 94 < own["peak_mb"] < 112, own
    assert both["peak_total_mb"] == pytest.approx(both["sum_peak_mb"], abs=0.1 * len(rows))
    assert both["sum_peak_mb"] == pytest.approx(sum(r["peak_mb"] for r in rows.values()), abs=0.1 * len(rows))
    later = {r["role"]: r for r in after["processes"]}
    assert later["child-1"] == only and after["samples"] == 2
    assert 126 < later["child-0"]["peak_mb"] < 145
    assert after["peak_total_mb"] == pytest.approx(both["peak_total_mb"], abs=8)
    # the peaks came at different times: their sum counts the shared pages once in each holder's peak
    assert after["sum_peak_mb"] > after["peak_total_mb"] + 24
