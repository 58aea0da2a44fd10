"""Async GRPO (grpo.async_grpo): rollouts generated ahead of training with bounded staleness.

Real Ray actors, real stores, the tiny model, three short steps per run. Versions count training steps:
step k starts from version k-1 and, with age a, may train rows of versions >= k-1-a.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest

from dataplane_rl.tasks import get_task
from test_train_e2e import SMALL, TRAIN_KEYS, assert_close, assert_store_failure_left_a_consistent_run, overriding, run

STEPS = "grpo.max_num_steps=3"
ASYNC = ["grpo.async_grpo.enabled=true"]
# the age-1 runs bound the weight: tis at ratio 1 truncates every rho above 1, so the rows one update
# behind show the bound at work; the error threshold sits far above any error, so it wires the masking path through
# the workers' counts without masking
AGE1 = [*ASYNC, "grpo.async_grpo.max_trajectory_age_steps=1", "loss_fn.use_importance_sampling_correction=true",
        "loss_fn.truncated_importance_sampling_type=tis", "loss_fn.truncated_importance_sampling_ratio=1.0",
        "grpo.seq_logprob_error_threshold=10.0"]


@pytest.fixture(scope="module")
def age1(tmp_path_factory, ray_session):
    return run(tmp_path_factory.mktemp("async"), "age1", "data_plane.enabled=true", STEPS, *AGE1)


@pytest.fixture(scope="module")
def sync3(tmp_path_factory, ray_session):
    return run(tmp_path_factory.mktemp("sync"), "sync", "data_plane.enabled=true", STEPS)


def test_age_0_gives_the_sync_rollouts_and_metrics(sync3, tmp_path):
    """Age 0 sends step k's batch right after refit k-1, as sync does: the same rows bit for bit, and
    the same step metrics; the async run also moves its columns with the data plane off."""
    _, sync_m, sync_d = sync3
    _, m, d = run(tmp_path, "age0", "data_plane.enabled=false", STEPS, *ASYNC,
                  "grpo.async_grpo.max_trajectory_age_steps=0")
    assert d == sync_d, "async age 0 generated other rollouts than sync"
    assert [x["step"] for x in m] == [1, 2, 3]
    for a, b in zip(m, sync_m):
        assert_close(a, b, rel=1e-5)
        assert a["async/enabled"] is True and b["async/enabled"] is False
        assert a["async/staleness_max"] == b["async/staleness_max"] == 0 and a["async/dropped_stale"] == 0
        assert a["timing/wait_for_rollouts"] > 0 and a["throughput/samples_per_s"] > 0


def test_age_1_trains_only_rows_within_the_bound(age1):
    summary, metrics, data = age1
    assert summary["status"] == "completed" and len(metrics) == 3
    task = get_task("repeat")
    for m, rows in zip(metrics, data.values()):
        k = m["step"]
        versions = [r["generation_policy_version"] for r in rows]
        assert min(versions) >= k - 1 - 1, (k, versions)
        # the schedule is deterministic: step k's batch was sent after refit max(0, k-2), one step ahead
        assert set(versions) == {max(0, k - 2)}, (k, set(versions))
        assert m["async/staleness_max"] == k - 1 - max(0, k - 2) == m["async/staleness_mean"]
        assert m["async/dropped_stale"] == 0 and len(rows) == 32
        for r in rows:
            assert r["total_reward"] == pytest.approx(task.reward(r["prompt"], r["response"]), abs=1e-6)
    # step 1 trains rows of the weights it starts from; step 2 rows of the initial weights, one update
    # behind: the recomputed prev_logprobs (version 1) now differ from the behaviour policy's
    assert metrics[0]["train/logprob_mismatch"] < 1e-5 < metrics[1]["train/logprob_mismatch"]
    # the bounded weight moves with the mismatch: off-policy steps truncate a share of the tokens, pull the mean
    # weight under 1 and the effective sample size under 1; the sequence errors measure the same gap
    for m in metrics[1:]:
        assert all(math.isfinite(m[f"train/{k}"]) for k in (
            "sampling_importance_ratio", "is_oob_ratio", "is_eff_sample_size", "mean_seq_mult_prob_error",
            "max_seq_mult_prob_error", "num_masked_seqs", "is_masked_seqs"))
        assert 0 < m["train/is_oob_ratio"] < 1 and m["train/sampling_importance_ratio"] < 1
        assert 0 < m["train/is_eff_sample_size"] < 1
        assert 1 < m["train/mean_seq_mult_prob_error"] <= m["train/max_seq_mult_prob_error"] < 10
        assert m["train/num_masked_seqs"] == 0 == m["train/is_masked_seqs"]


def test_age_above_0_needs_importance_sampling_correction():
    from dataplane_rl.config import load_config
    from dataplane_rl.errors import ConfigError

    with pytest.raises(ConfigError, match=r"max_trajectory_age_steps=1.*loss_fn\.use_importance_sampling_correction"):
        load_config(None, ASYNC)
    load_config(None, [*ASYNC, "grpo.async_grpo.max_trajectory_age_steps=0"])


def test_fresh_groups_drops_whole_groups_older_than_the_bound():
    from dataplane_rl.driver.rollouts import fresh_groups

    versions = np.array([3, 3, 2, 3, 1, 1, 3, 3])  # [n]
    groups = np.array([0, 0, 1, 1, 2, 2, 3, 3])    # [n]
    keep, dropped = fresh_groups(versions, groups, oldest=3)
    assert keep.tolist() == [0, 3] and dropped == 4  # group 1 has one old row: the whole group goes
    keep, dropped = fresh_groups(versions, groups, oldest=1)
    assert keep.tolist() == [0, 1, 2, 3] and dropped == 0


def mooncake_or_skip() -> None:
    from conftest import backend_unavailable

    try:
        import dataplane_rl.store.mooncake  # noqa: F401
    except ImportError as e:
        backend_unavailable("mooncake", str(e))


class Killer(threading.Thread):
    """Signals processes of an in-process run by the PIDs it recorded in RUN_DIR/actors.json, following `script`:
    ("actors",) waits for actors.json, ("line", n) for metrics.jsonl's n-th line, ("step", n) for a line of step n,
    ("checkpoint", n) for checkpoint n to be complete; ("stop" | "kill" | "cont", kind, i) sends SIGSTOP, SIGKILL or SIGCONT to rollout actor i,
    train rank i or the store's holder i (kind "rollout", "train", "store"); ("sleep", s) waits s seconds. Every
    wait is bounded and ends when the run does."""

    SIGNALS = {"stop": signal.SIGSTOP, "kill": signal.SIGKILL, "cont": signal.SIGCONT}

    def __init__(self, run_dir, script: list[tuple]) -> None:
        super().__init__(daemon=True)
        self.run_dir, self.script, self.killed, self.error = run_dir, script, [], None
        self.done = threading.Event()

    def wait(self, ready, what: str) -> None:
        deadline = time.monotonic() + 240
        while not ready():
            if time.monotonic() > deadline or self.done.is_set():
                raise TimeoutError(f"{what} did not come (the run ended or 240 s passed)")
            time.sleep(0.002)

    def pid(self, kind: str, index: int) -> int:
        a = json.loads((self.run_dir / "actors.json").read_text())
        if kind == "store":
            return [h for h in a["store"] if h["process"] == "holder"][index]["pid"]
        return a[kind][index]["pid"]

    def run(self) -> None:
        metrics = self.run_dir / "metrics.jsonl"
        stopped: set[int] = set()
        try:
            for what, *args in self.script:
                if what == "actors":
                    self.wait((self.run_dir / "actors.json").is_file, "actors.json")
                elif what == "line":
                    self.wait(lambda: metrics.is_file() and len(metrics.read_text().splitlines()) >= args[0], f"line {args[0]}")
                elif what == "step":
                    self.wait(lambda: metrics.is_file() and any(json.loads(x)["step"] == args[0] for x in
                                                                metrics.read_text().splitlines()), f"step {args[0]}")
                elif what == "checkpoint":
                    self.wait((self.run_dir / "checkpoints" / f"step_{args[0]:06d}").is_dir, f"checkpoint {args[0]}")
                elif what == "sleep":
                    time.sleep(args[0])
                else:
                    pid = self.pid(*args)
                    os.kill(pid, self.SIGNALS[what])
                    if what == "kill":
                        self.killed.append((*args, pid))
                    stopped = (stopped | {pid}) if what == "stop" else (stopped - {pid})
        except BaseException as e:  # noqa: BLE001 - reported by the test
            self.error = e
        finally:
            for pid in stopped:  # never leave a process of the run stopped (the run would wait for it)
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGCONT)

    def start_for(self, run):
        self.start()
        try:
            return run()
        finally:
            self.done.set()
            self.join(timeout=30)


def last_lines(metrics: list[dict]) -> list[dict]:
    """Each step's last metrics line (a step run again after an in-run resume is logged again, marked)."""
    return list({m["step"]: m for m in metrics}.values())


def test_mooncake_backend_gives_the_shm_run_through_a_dead_holder_and_a_dead_train_rank(age1, tmp_path):
    """The async schedule is deterministic, so the same run on Mooncake trains the same rows, bit for bit,
    to the same numbers (within 1e-5: buffers of another alignment take other SIMD summation orders); and it
    still does when a holder of its store and its train rank are SIGKILLed mid-run (checkpoints every step):
    the holder once checkpoint 1 is complete (noticed in step 2, or on a loaded machine only after step 2's line
    is written, which is then logged again, marked; async rows of older weights died with it, so the run resumes
    from checkpoint 1 in-process with a new store), then the train rank, stopped the moment step 3's line is
    written and killed in the middle of checkpoint 3's save (the run resumes from checkpoint 2 and logs step 3
    again, marked). Every step's numbers are the unkilled run's."""
    mooncake_or_skip()
    _, base_m, base_d = age1
    # the train rank is stopped the moment step 3's line is written, so it dies in the middle of checkpoint 3's save
    killer = Killer(tmp_path / "mc", [("checkpoint", 1), ("kill", "store", 1), ("step", 3), ("stop", "train", 0),
                                      ("sleep", 0.5), ("kill", "train", 0)])
    summary, m, d = killer.start_for(lambda: run(
        tmp_path, "mc", "data_plane.enabled=true", "data_plane.backend=mooncake://", "data_plane.mooncake.num_holders=2",
        STEPS, *AGE1, "checkpointing.enabled=true", "checkpointing.save_period=1"))
    assert killer.error is None and len(killer.killed) == 2, (killer.error, killer.killed)
    assert summary["status"] == "completed" and summary["store_url"].startswith("mooncake://")
    assert d == base_d
    # the killer's thread shares the driver's process: on a loaded machine step 2 can end before the holder dies
    late = [x["step"] for x in m[:3]] == [1, 2, 2]
    assert [(x["step"], x["faults/rerun"]) for x in m] == [(1, 0), (2, 0)] + [(2, 1)] * late + [(3, 0), (3, 1)]
    for a, b in zip(last_lines(m), base_m):
        for k in TRAIN_KEYS:  # logprob_mismatch too: off-policy, it is no longer rounding noise
            assert math.isclose(a[k], b[k], rel_tol=1e-5, abs_tol=1e-7), f"step {a['step']} {k}: {a[k]} vs {b[k]}"
        assert a["async/staleness_max"] == b["async/staleness_max"]
    faults = summary["faults"]
    assert [(f["what"], f["step"], f["budget"]["used"]) for f in faults] == [("store holder died", 2, 1),
                                                                            ("train rank died", 3, 2)], faults
    assert faults[0]["where"]["store"] != summary["store_url"] and "checkpoint of step 1" in faults[0]["recovery"]
    assert faults[1]["where"]["pid"] == killer.killed[1][2] and "checkpoint of step 2" in faults[1]["recovery"]
    assert faults[1]["cost"]["steps_rerun"] == 1 and Path(faults[1]["output"]).is_file()
    last = m[-1]
    assert (last["faults/store_restarts_total"], last["faults/train_restarts_total"], last["faults/steps_rerun_total"]) == (1, 1, 1 + late)
    assert last["faults/seconds_lost_total"] > 0 and base_m[-1]["faults/train_restarts_total"] == 0
    assert summary["steps_completed"] == 3


def test_a_dead_holder_in_sync_grpo_regenerates_the_step_without_a_checkpoint(sync3, tmp_path):
    """Sync GRPO, no checkpoints: a holder of the run's Mooncake store SIGKILLed while step 1 waits for its rows (the
    rollout actor held with SIGSTOP meanwhile); the run replaces the store, every actor opens the new one, and step 1
    runs again from its start (its prompts, seeds and weights are its own): every row and number is the unkilled
    run's."""
    mooncake_or_skip()
    _, base_m, base_d = sync3
    # the rollout actor is stopped before step 1's job can run: the holder dies while the step waits for its rows
    killer = Killer(tmp_path / "mc", [("actors",), ("stop", "rollout", 0), ("kill", "store", 0), ("sleep", 0.5),
                                      ("cont", "rollout", 0)])
    summary, m, d = killer.start_for(lambda: run(
        tmp_path, "mc", "data_plane.enabled=true", "data_plane.backend=mooncake://", "data_plane.mooncake.num_holders=2",
        STEPS))
    assert killer.error is None and killer.killed, killer.error
    assert summary["status"] == "completed" and d == base_d
    assert [x["step"] for x in m] == [1, 2, 3] and not any(x["faults/rerun"] for x in m)
    for a, b in zip(m, base_m):
        assert_close(a, b, rel=1e-5)
    (fault,) = summary["faults"]
    assert fault["what"] == "store holder died" and fault["step"] == 1 and "ran step 1 again" in fault["recovery"]
    assert f"pid {killer.killed[0][2]}" in fault["error"] and m[-1]["faults/store_restarts_total"] == 1
    actors = json.loads((tmp_path / "mc" / "actors.json").read_text())
    assert killer.killed[0][2] not in [h["pid"] for h in actors["store"]]


def test_a_bounded_wait_names_the_step_and_the_missing_groups(tmp_path, ray_session):
    from dataplane_rl.driver.loop import RolloutWaitError

    with pytest.raises(RolloutWaitError, match=r"step 1: partition step-000001 groups 0-7 not complete after 0.001 s "
                                               r"\(grpo.async_grpo.wait_timeout_s\)"):
        run(tmp_path, "slow", "data_plane.enabled=true", *AGE1, "grpo.async_grpo.wait_timeout_s=0.001")
    summary = json.loads((tmp_path / "slow" / "summary.json").read_text())
    assert summary["status"] == "failed" and "wait_timeout_s" in summary["error"]


def test_a_rollout_actor_killed_mid_run_fails_clearly(tmp_path):
    """SIGKILL to the rollout actor while steps are generated ahead: the run stops with a RolloutActorError
    (exit 2), and the run folder holds whole lines, one train_data file per logged step, a failed summary."""
    import psutil

    run_dir = tmp_path / "kill"
    proc = subprocess.Popen([sys.executable, "-m", "dataplane_rl.cli.main", "train",
                             *overriding(SMALL, "grpo.max_num_steps=300"), "fault_tolerance.max_generation_failures=0",
                             f"logger.run_dir={run_dir}", "data_plane.enabled=true", *AGE1],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env=dict(os.environ, PYTHONUNBUFFERED="1"))
    try:
        metrics = run_dir / "metrics.jsonl"
        deadline = time.monotonic() + 300
        while not (metrics.is_file() and metrics.read_text()):
            assert proc.poll() is None, f"the run exited ({proc.returncode}) before step 1: {proc.stdout.read()[-3000:]}"
            assert time.monotonic() < deadline, "no step 1 within 300 s"
            time.sleep(0.5)
        actors = [c for c in psutil.Process(proc.pid).children(recursive=True) if "RolloutWorker" in " ".join(c.cmdline())]
        assert len(actors) == 1, [c.cmdline() for c in psutil.Process(proc.pid).children(recursive=True)]
        os.kill(actors[0].pid, signal.SIGKILL)
        out, _ = proc.communicate(timeout=300)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    assert_store_failure_left_a_consistent_run(proc.returncode, out, run_dir, errors=("RolloutActorError",))
    assert "a rollout actor died" in out
