"""The group replay buffer (driver/replay.py): its choices and bounds, then a real 30-step run that holds them in its
stored rows and metrics, killed at step 15 and resumed onto the same row sets."""

from __future__ import annotations

import json
import math
import os
import shutil
from collections import Counter
from pathlib import Path

import numpy as np
import pytest

from dataplane_rl.config import load_config
from dataplane_rl.config.replay import ReplayConfig
from dataplane_rl.driver.replay import Entry, ReplayBuffer
from dataplane_rl.errors import ConfigError
from dataplane_rl.store import open_store


def entry(pid: str, version: int, advantage: float = 1.0, rows=(0, 1)) -> Entry:
    return Entry(pid, list(rows), version, version + 1, 0.5, 0.5, advantage, "count")


def buffer(**kw) -> ReplayBuffer:
    return ReplayBuffer(ReplayConfig(enabled=True, **kw), seed=0)


def test_fifo_and_recency_take_the_oldest_or_newest_eligible_and_count_each_use():
    b = buffer(strategy="fifo", max_reuse=2, max_staleness=5)
    b.admit([entry(f"p{i}", i) for i in range(4)])
    assert [e.pid for e in b.take(2, version=4)] == ["p0", "p1"]
    assert [e.pid for e in b.take(3, version=4)] == ["p0", "p1", "p2"]  # p0, p1 once used: still eligible
    assert [e.pid for e in b.take(9, version=4)] == ["p2", "p3"]  # p0, p1 used twice: max_reuse reached
    r = buffer(strategy="recency", max_staleness=5)
    r.admit([entry(f"p{i}", i) for i in range(4)])
    assert [e.pid for e in r.take(2, version=4)] == ["p2", "p3"]


def test_staleness_bounds_what_a_step_may_replay_and_what_eviction_keeps():
    b = buffer(strategy="fifo", max_staleness=2, max_reuse=9)
    b.admit([entry("old", 0), entry("mid", 1), entry("new", 2)])
    assert [e.pid for e in b.take(3, version=3)] == ["mid", "new"]  # version 3: "old" is 3 versions old
    assert b.evict(version=3) == ["old"] and b.evicted == {"staleness": 1, "reuse": 0, "capacity": 0}
    assert b.evict(version=4) == ["mid"]  # the next step (weights 4) could not replay it any more


def test_reuse_and_capacity_evict_and_a_partition_is_freed_only_with_its_last_entry():
    b = buffer(strategy="fifo", max_reuse=1, capacity_groups=2, max_staleness=9)
    b.admit([entry("a", 0, rows=(0, 1)), entry("a", 0, rows=(2, 3)), entry("b", 0), entry("c", 0)])
    assert b.evict(version=1) == ["a"]  # capacity 2: both of a's groups go (oldest first); a is free
    assert b.pinned() == {"b", "c"} and b.evicted["capacity"] == 2
    b.begin_step()
    b.take(1, version=1)
    assert b.evict(version=1) == ["b"] and b.evicted == {"staleness": 0, "reuse": 1, "capacity": 0}


def test_priority_prefers_large_advantages_and_its_draws_resume_from_the_state():
    b = buffer(strategy="priority", max_reuse=10**6, max_staleness=10**6, capacity_groups=10)
    b.admit([entry("big", 0, advantage=9.0), entry("small", 0, advantage=1.0)])
    picks = Counter(b.take(1, version=0)[0].pid for _ in range(2000))
    # by hand: P(big) = 9 / (9 + 1) = 0.9, so ~1800 of 2000; 1700 is 8 standard deviations (sqrt(2000*.9*.1)=13) off
    assert picks["big"] > 1700 and picks["small"] > 100, picks
    saved = json.loads(json.dumps(b.state_dict()))  # the checkpoint's JSON
    again = buffer(strategy="priority", max_reuse=10**6, max_staleness=10**6, capacity_groups=10)
    again.load_state_dict(saved)
    assert [again.take(1, 0)[0].pid for _ in range(50)] == [b.take(1, 0)[0].pid for _ in range(50)]
    assert [e.uses for e in again.entries] == [e.uses for e in b.entries]


def test_uniform_draws_without_replacement_within_a_step():
    b = buffer(strategy="uniform", max_staleness=9)
    b.admit([entry(f"p{i}", 0) for i in range(6)])
    got = [e.pid for e in b.take(6, version=0)]
    assert sorted(got) == [f"p{i}" for i in range(6)] and b.metrics()["replay/reused_groups"] == 6


def test_difficulty_pools_give_their_fractions_and_a_short_pool_leaves_its_places_to_the_rest():
    b = buffer(strategy="fifo", max_staleness=9, easy_threshold=0.8, hard_threshold=0.2, easy_fraction=0.25,
               hard_fraction=0.5)
    rewards = {"e1": 0.9, "e2": 0.85, "h1": 0.1, "h2": 0.2, "h3": 0.05, "m1": 0.5, "m2": 0.6}
    b.admit([Entry(pid, [0], 0, 1, r, 0.3, 1.0, "count") for pid, r in rewards.items()])
    # 4 places: round(4 x 0.25) = 1 easy, round(4 x 0.5) = 2 hard, 1 between; fifo in each, admission order out
    assert [e.pid for e in b.take(4, version=0)] == ["e1", "h1", "h2", "m1"]
    m = b.metrics()
    assert (m["replay/reused_easy_groups"], m["replay/reused_hard_groups"]) == (1, 2)
    short = buffer(strategy="fifo", max_staleness=9, hard_threshold=0.2, hard_fraction=1.0)
    short.admit([Entry(pid, [0], 0, 1, r, 0.3, 1.0, "count") for pid, r in rewards.items()])
    # 4 hard places, 3 hard groups: the fourth goes to the oldest group left
    assert [e.pid for e in short.take(4, version=0)] == ["e1", "h1", "h2", "h3"]
    for bad, match in ((["grpo.replay.easy_fraction=0.6", "grpo.replay.hard_fraction=0.6", "grpo.replay.easy_threshold=0.9",
                         "grpo.replay.hard_threshold=0.1"], "more than all"),
                       (["grpo.replay.hard_fraction=0.5"], "hard_threshold does not define"),
                       (["grpo.replay.easy_threshold=0.3", "grpo.replay.hard_threshold=0.3"], "not below easy_threshold")):
        with pytest.raises(ConfigError, match=match):
            load_config(None, ["grpo.replay.enabled=true", *bad])


def test_the_config_refuses_replay_with_async_grpo_and_too_few_fresh_rows_for_the_ranks():
    with pytest.raises(ConfigError, match="grpo.replay.enabled=true needs grpo.async_grpo.enabled=false"):
        load_config(None, ["grpo.replay.enabled=true", "grpo.async_grpo.enabled=true",
                           "grpo.async_grpo.max_trajectory_age_steps=0"])
    with pytest.raises(ConfigError, match="grpo.replay.fresh_fraction=0.1 leaves fewer fresh rows"):
        load_config(None, ["grpo.replay.enabled=true", "grpo.replay.fresh_fraction=0.1", "grpo.num_prompts_per_step=2",
                           "grpo.num_generations_per_prompt=2", "policy.dp_size=4", "policy.train_global_batch_size=4",
                           "policy.train_micro_batch_size=1"])
    assert load_config(None, []).grpo.replay.enabled is False


# ---- a real run ------------------------------------------------------------------------------------------
REPLAY = ["grpo.replay.enabled=true", "grpo.replay.strategy=priority", "grpo.replay.max_reuse=2",
          "grpo.replay.max_staleness=2", "grpo.replay.capacity_groups=6", "grpo.max_num_steps=30",
          "checkpointing.save_period=15", "data_plane.enabled=true"]


def made_at(sample_id: str) -> int:
    """The step whose round made the row: step-000007/3 -> 7."""
    return int(sample_id.split("/")[0].split("-")[1])


def train_data(run_dir: Path) -> dict[int, list[dict]]:
    return {int(p.stem.split("_")[1]): [json.loads(x) for x in p.read_text().splitlines()]
            for p in sorted((run_dir / "train_data").iterdir())}


@pytest.fixture(scope="module")
def straight(tmp_path_factory, ray_session):
    from test_checkpoint import straight_run

    run_dir = tmp_path_factory.mktemp("replay") / "straight"
    return run_dir, straight_run(run_dir, *REPLAY)


def test_a_30_step_priority_run_holds_every_bound_in_its_rows_and_metrics(straight):
    """Every replayed row is the admitted row (same reward, advantage, version), no group trains more than
    1 + max_reuse times nor with weights more than max_staleness versions newer than its own, the buffer stays
    within capacity and its pinned partitions within max_staleness + 1, and steps do replay."""
    _, metrics = straight
    rows = train_data(straight[0])
    first: dict[str, dict] = {}
    uses: Counter = Counter()
    for step, trained in rows.items():
        for r in trained:
            if made_at(r["sample_id"]) == step:
                first[r["sample_id"]] = r
                continue
            seen = first[r["sample_id"]]  # replayed: trained first by the step that made it
            assert (r["total_reward"], r["advantage"], r["generation_policy_version"]) == (
                seen["total_reward"], seen["advantage"], seen["generation_policy_version"]), r["sample_id"]
            assert (step - 1) - r["generation_policy_version"] <= 2, (step, r)
            uses[r["sample_id"]] += 1
    assert uses and max(uses.values()) <= 2
    replayed = [m["replay/reused_groups"] for m in metrics]
    assert sum(replayed) >= 15 and all(n <= 2 for n in replayed)  # 4 prompts a step: 2 fresh, up to 2 replayed
    assert sum(sum(1 for r in rows[m["step"]] if made_at(r["sample_id"]) < m["step"]) for m in metrics) \
        == 4 * sum(replayed)  # each replayed group is its 4 rows
    for m in metrics:
        assert m["replay/staleness_max"] <= 2 and m["replay/reuse_max"] <= 2 and m["replay/size_groups"] <= 6
        assert m["replay/partitions"] <= 3 and m["replay/fresh_groups"] + m["replay/reused_groups"] == 4
    assert sum(m["replay/evicted_groups"] for m in metrics) > 0


def test_a_run_killed_at_step_15_resumes_onto_the_same_row_sets_and_its_store_held_only_pinned_partitions(
        straight, tmp_path):
    from dataplane_rl.checkpoint.resume import resume_config
    from dataplane_rl.driver.loop import train
    from test_checkpoint import KEYS, kill_after_checkpoint, read_metrics
    from test_resume import assert_same_rows

    straight_dir, expected = straight
    run_dir = tmp_path / "killed"
    shm = Path("/dev/shm") / f"dataplane-rl-test-{os.getpid()}-{tmp_path.name}"  # kill -9 skips the store's close
    try:
        kill_after_checkpoint(run_dir, 15, *REPLAY, f"data_plane.backend=shm://{shm}")
        left = open_store(f"shm://{shm}")
        try:
            live = set(left.list_partitions())
        finally:
            left.close()
    finally:
        shutil.rmtree(shm, ignore_errors=True)
    saved = json.loads((run_dir / "checkpoints" / "step_000015" / "driver.json").read_text())["replay"]
    pinned = {p["pid"] for p in saved["partitions"]}
    assert pinned and len(pinned) <= 3 and all(made_at(p) > 15 - 3 for p in pinned)
    # what the killed run's store held: the pinned partitions, and at most the step under way when it died
    assert pinned <= live and live - pinned <= {"step-000016"}, (live, pinned)
    again = shm.with_name(shm.name + "-resumed")  # a named store outlives the run: what it holds after is seen
    try:
        summary = train(resume_config(run_dir, [f"data_plane.backend=shm://{again}"]), resume=True)
        after = open_store(f"shm://{again}")
        try:
            assert after.list_partitions() == [], "the run's end drops the partitions the buffer still pinned"
        finally:
            after.close()
    finally:
        shutil.rmtree(again, ignore_errors=True)
    assert summary["status"] == "completed"
    got = read_metrics(run_dir)
    assert [m["step"] for m in got] == [m["step"] for m in expected]
    for x, y in zip(got, expected):
        for k in (*KEYS, "replay/size_groups", "replay/reused_groups", "replay/staleness_mean", "replay/evicted_groups"):
            assert math.isclose(x[k], y[k], rel_tol=1e-6, abs_tol=1e-9), f"step {x['step']} {k}: {x[k]} vs {y[k]}"
    from test_resume import train_data as by_file

    assert_same_rows(by_file(run_dir), by_file(straight_dir))


def test_a_checkpoint_with_a_buffer_is_refused_by_a_run_without_one(straight, tmp_path):
    from dataplane_rl.checkpoint.files import CheckpointError
    from dataplane_rl.checkpoint.replay import restore_replay

    ckpt = straight[0] / "checkpoints" / "step_000030"
    saved = json.loads((ckpt / "driver.json").read_text())["replay"]
    assert saved["state"]["entries"]
    with pytest.raises(CheckpointError, match="resume with grpo.replay.enabled=true"):
        restore_replay(None, None, ckpt, saved, None)
    assert np.all([len(p["rows"]) for p in saved["partitions"]])
