"""Resume that continues the interrupted run: async GRPO with its rounds generated ahead, on another shape.

Each case kills a real CLI run with SIGKILL after checkpoint 2 and resumes it; the straight run it is
compared with goes in-process on the session's Ray. Sync resume on another shape (dp 1->2, dp 2->1 with
rollout actors 2->1) is in test_checkpoint.py next to the same-shape case it shares its straight run with.
"""

from __future__ import annotations

import json
import math
import os
import pickle
import shutil
from pathlib import Path

import pytest

from test_checkpoint import (KEYS, MULTI_TURN, Payload, assert_export_is_the_final_policy, cli, kill_after_checkpoint,
                             kill_rollout_actors, read_metrics, straight_run)

ASYNC_KEYS = (*KEYS, "train/filtered_reward", "train/generation_rounds", "train/lr", "async/staleness_mean",
              "async/staleness_max", "async/dropped_stale")
IS = "loss_fn.use_importance_sampling_correction=true"
CASES = {
    # checkpoint 2 holds step 3, generated with version 1; resumed with the data plane off (portability)
    "age1": (["grpo.async_grpo.enabled=true", "grpo.async_grpo.max_trajectory_age_steps=1", IS,
              "data_plane.enabled=true"], ["data_plane.enabled=false"], 1),
    # checkpoint 2 holds steps 3 and 4 (versions 0 and 1); dynamic sampling adds rounds of the current weights;
    # multi-turn rows (guess): async, dynamic sampling, exact resume and export on episodes
    "age2_dynamic_multiturn": (["grpo.async_grpo.enabled=true", "grpo.async_grpo.max_trajectory_age_steps=2", IS,
                                "grpo.max_num_steps=4", "grpo.use_dynamic_sampling=true", "grpo.max_gen_batches=8",
                                *MULTI_TURN], [], 2),
}


def train_data(run_dir: Path) -> dict[str, list[dict]]:
    return {p.name: [json.loads(x) for x in p.read_text().splitlines()]
            for p in sorted((run_dir / "train_data").iterdir())}


def assert_same_rows(got: dict, expected: dict) -> None:
    """The same rows trained at every step, in the same order: none twice, none skipped."""
    assert list(got) == list(expected)
    for name in expected:
        assert len(got[name]) == len(expected[name]), name
        for a, b in zip(got[name], expected[name]):
            assert math.isclose(a.pop("advantage"), b.pop("advantage"), rel_tol=1e-6, abs_tol=1e-9), (name, a)
            assert a == b, name


def refuse_a_crafted_partition(ckpt: Path, tmp_path: Path) -> None:
    from dataplane_rl.checkpoint.manager import CheckpointManager
    from dataplane_rl.checkpoint.files import CheckpointError, write_manifest

    copy = tmp_path / "crafted" / ckpt.name
    shutil.copytree(ckpt, copy)
    part = next((copy / "partitions").iterdir())
    part.write_bytes(pickle.dumps(Payload(tmp_path / "pwned")))
    write_manifest(copy, 2)
    with pytest.raises(CheckpointError, match=part.name):
        CheckpointManager(copy.parent).check(copy)
    assert not (tmp_path / "pwned").exists()


@pytest.fixture(scope="module")
def straights(tmp_path_factory, ray_session):
    """Each case's unkilled run, made once for the tests that compare with it: case -> (run folder, metrics)."""
    made: dict = {}

    def get(case: str) -> tuple[Path, list[dict]]:
        if case not in made:
            run_dir = tmp_path_factory.mktemp(case) / "straight"
            made[case] = run_dir, straight_run(run_dir, *CASES[case][0])
        return made[case]

    return get


@pytest.mark.parametrize("case", list(CASES))
def test_async_kill_9_then_resume_continues_the_run(case, tmp_path, straights):
    from dataplane_rl.driver.loop import train
    from dataplane_rl.checkpoint.resume import resume_config

    overrides, on_resume, age = CASES[case]
    straight_dir, expected = straights(case)
    run_dir = tmp_path / "killed"
    shm = Path("/dev/shm") / f"dataplane-rl-test-{os.getpid()}-{tmp_path.name}"  # kill -9 skips the store's close
    named = [f"data_plane.backend=shm://{shm}"] if "data_plane.enabled=true" in overrides else []
    try:
        kill_after_checkpoint(run_dir, 2, *overrides, *named)
    finally:
        shutil.rmtree(shm, ignore_errors=True)
    ckpt = run_dir / "checkpoints" / "step_000002"
    saved = sorted(p.name for p in (ckpt / "partitions").iterdir())
    assert saved == [f"step-{k:06d}.arrow" for k in range(3, 3 + age)], saved
    if case == "age1":
        refuse_a_crafted_partition(ckpt, tmp_path)
    summary = train(resume_config(run_dir, ["data_plane.backend=shm://", *on_resume]), resume=True)
    assert summary["status"] == "completed"
    got = read_metrics(run_dir)
    assert [m["step"] for m in got] == [m["step"] for m in expected]
    for x, y in zip(got, expected):
        for k in ASYNC_KEYS:
            assert math.isclose(x[k], y[k], rel_tol=1e-6, abs_tol=1e-9), f"step {x['step']} {k}: {x[k]} vs {y[k]}"
    assert_same_rows(train_data(run_dir), train_data(straight_dir))
    ahead = [r for r in train_data(run_dir)["step_000003.jsonl"] if r["sample_id"].startswith("step-000003/")]
    assert ahead and {r["generation_policy_version"] for r in ahead} == {3 - 1 - age}, \
        "step 3 trains the rows generated before the kill, with the weights of then"
    if case == "age2_dynamic_multiturn":
        assert_multi_turn_rows_export(run_dir, got, tmp_path)


def test_async_rollout_actor_killed_with_steps_ahead_is_replaced(tmp_path, straights):
    """Async GRPO (age 1), two rollout actors: one SIGKILLed with the steps sent ahead at the start unfinished
    (docs/faults.md). It is replaced with the weights those jobs were sent with, they run again, and every step
    trains the unkilled run's rows to its numbers."""
    straight_dir, expected = straights("age1")
    run_dir = tmp_path / "killed"
    code, out = kill_rollout_actors(run_dir, [("start", 1)], *CASES["age1"][0], "generation.num_workers=2")
    assert code == 0, out[-3000:]
    got = read_metrics(run_dir)
    # the same rows, and numbers equal to float32 rounding: this run's two rollout actors each generate half of a
    # step's prompts, the straight run's one actor all of them, and a batch of another shape sums the engine's
    # log-probs in another order (rel 1.7e-6 apart on the Intel VM; train/logprob_mismatch, itself float noise of
    # ~1e-7, 2e-8 apart)
    for x, y in zip(got, expected, strict=True):
        for k in ASYNC_KEYS:
            assert math.isclose(x[k], y[k], rel_tol=1e-5, abs_tol=1e-6), f"step {x['step']} {k}: {x[k]} vs {y[k]}"
    assert_same_rows(train_data(run_dir), train_data(straight_dir))
    faults = json.loads((run_dir / "summary.json").read_text())["faults"]
    assert len(faults) == 1 and faults[0]["where"]["slot"] == 1 and faults[0]["cost"]["jobs_redispatched"] >= 1, faults
    assert got[-1]["rollout/actor_restarts_total"] == 1 and got[-1]["rollout/redispatch_total"] >= 1


def assert_multi_turn_rows_export(run_dir: Path, metrics: list[dict], tmp_path: Path) -> None:
    """The resumed run trained episodes (dynamic sampling kept only groups with spread), and its export is the
    final policy, loadable in transformers."""
    import torch
    from transformers import AutoModelForCausalLM

    assert all(m["rollout/num_turns_mean"] > 1 and m["rollout/env_tokens_mean"] > 0 for m in metrics)
    for name, rows in train_data(run_dir).items():
        groups = {}  # a group is its round's partition and its index in the round
        for r in rows:
            groups.setdefault((r["sample_id"].split("/")[0], r["group_id"]), set()).add(r["total_reward"])
        assert all(len(v) > 1 for v in groups.values()), f"{name}: a group without spread was trained"
        assert {r["end_reason"] for r in rows} <= {"done", "max_turns", "length"}
    out = tmp_path / "hf"
    p = cli("export", str(run_dir), str(out))
    assert p.returncode == 0, p.stderr[-3000:]
    assert_export_is_the_final_policy(run_dir, out)
    AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)
