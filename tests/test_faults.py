"""Failures a run survives (docs/faults.md), at the level of their parts, with real actors, stores and kills.

The end-to-end kills share their unkilled runs with the checkpoint tests: the chaos run (two rollout actors
killed) is in test_checkpoint.py, the async one in test_resume.py.
"""

from __future__ import annotations

import os
import signal

import numpy as np
import pyarrow as pa
import pytest

from dataplane_rl.config import load_config

ROLLOUT = ["input_ids", "generation_logprobs", "total_reward", "group_id", "response_text", "generation_policy_version"]


def test_a_retried_job_writes_only_the_cells_not_yet_committed(tmp_path):
    """A job's first attempt committed some cells before its actor died: the retry puts the rest, never a cell twice."""
    from dataplane_rl.columns.actor_io import ActorIO
    from dataplane_rl.schema import load_schema
    from dataplane_rl.store import open_store

    store = open_store(f"shm://{tmp_path}/s")
    io = ActorIO(store.url)
    try:
        store.create_partition("p", load_schema("grpo"), 6)
        rows = np.arange(2, 6)  # the job's rows
        table = pa.table({"total_reward": pa.array([1.0, 2.0, 3.0, 4.0], pa.float32()),
                          "group_id": pa.array([7, 7, 8, 8], pa.int64())})
        store.put("p", {"total_reward": table.column("total_reward").slice(0, 4)}, rows)  # committed: all rewards
        store.put("p", {"group_id": table.column("group_id").slice(0, 1)}, rows[:1])  # and one group id
        out, written = io.emit_missing("p", rows, table)
        assert out is None and written == 3  # group_id on rows 3-5: the most rows any column still missed
        got = store.get("p", ["total_reward", "group_id"], rows)
        assert got.column("total_reward").to_pylist() == [1.0, 2.0, 3.0, 4.0]
        assert got.column("group_id").to_pylist() == [7, 7, 8, 8]
        assert io.emit_missing("p", rows, table) == (None, 0), "a job retried after a whole commit writes nothing"
        off = ActorIO(None)  # the data plane off: the rows travel as the call's result, all of them
        assert off.emit_missing("p", rows, table) == (table, 4)
    finally:
        io.close()
        store.close()


def test_a_replacement_runs_each_unfinished_job_with_the_weights_it_was_sent_with(tmp_path, ray_session):
    """Async GRPO: a job sent with weights 1 waits behind a stopped actor while the trainer moves on to weights 2;
    the actor is SIGKILLed. Its replacement loads weights 1 for that job (the rows equal the ones a live actor
    wrote for the same prompts with weights 1), then weights 2, and the run goes on."""
    from dataplane_rl.driver.trainer import GRPOTrainer

    cfg = load_config(None, ["grpo.num_prompts_per_step=2", "grpo.num_generations_per_prompt=2", "grpo.max_num_steps=3",
                             "policy.train_global_batch_size=4", "policy.train_micro_batch_size=2",
                             "generation.max_new_tokens=4", "generation.num_workers=2", "data_plane.enabled=true",
                             "grpo.async_grpo.enabled=true", "loss_fn.use_importance_sampling_correction=true",
                             f"logger.run_dir={tmp_path / 'run'}"])
    t = GRPOTrainer(cfg)
    try:
        t.start()
        t.rollouts.send_ahead(0)
        t.step(1)  # weights 1 go to the actors, step 3 is sent with them
        prompts = t.task.prompts(cfg.grpo.seed, 9, 0, 2)
        t.rollouts.collect(t.rollouts.send("ref", 9, 0, prompts, 2))  # both actors, weights 1
        victim = t.recovery.pids[1]
        os.kill(victim, signal.SIGSTOP)
        try:
            t.rollouts.send("again", 9, 0, prompts, 2)  # queued behind the stop, sent with weights 1
            t.step(2)  # weights 2 queued behind it too
        finally:
            os.kill(victim, signal.SIGKILL)
        t.rollouts.collect(t.rollouts.open["again"])
        assert t.store.get("again", ROLLOUT).equals(t.store.get("ref", ROLLOUT))
        assert set(t.store.get("again", ["generation_policy_version"]).column(0).to_pylist()) == {1}
        assert (t.recovery.restarts, t.recovery.redispatched) == (1, 1) and t.recovery.pids[1] != victim
        m, _ = t.step(3)  # the replacement holds weights 2 now; step 3 was generated before the kill
        assert m["rollout/actor_restarts_total"] == 1 and m["rollout/rows_regenerated_total"] == 2
        assert len(t.recovery.faults) == 1 and t.recovery.faults[0]["where"]["pid"] == victim
    finally:
        t.close()


def test_the_budget_names_its_key_when_it_runs_out():
    from dataplane_rl.config import load_config as load
    from dataplane_rl.errors import ConfigError

    assert load(None, []).fault_tolerance.max_generation_failures == 3
    with pytest.raises(ConfigError, match="fault_tolerance.max_generation_failures"):
        load(None, ["fault_tolerance.max_generation_failures=-1"])
