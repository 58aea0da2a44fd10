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
    from dataplane_rl.driver.fleet import Fleet
    from dataplane_rl.driver.step import grpo_step
    from dataplane_rl.run.progress import Progress

    cfg = load_config(None, ["grpo.num_prompts_per_step=2", "grpo.num_generations_per_prompt=2", "grpo.max_num_steps=3",
                             "policy.train_global_batch_size=4", "policy.train_micro_batch_size=2",
                             "generation.max_new_tokens=4", "generation.num_workers=2", "data_plane.enabled=true",
                             "grpo.async_grpo.enabled=true", "loss_fn.use_importance_sampling_correction=true",
                             f"logger.run_dir={tmp_path / 'run'}"])
    progress = Progress()
    t = Fleet(cfg, progress=progress)
    try:
        t.start()
        t.rollouts.send_ahead(0)
        grpo_step(t, progress, 1)  # weights 1 go to the actors, step 3 is sent with them
        prompts = t.sampler.draw(cfg.grpo.seed, 9, 0, 2)
        t.rollouts.collect(t.rollouts.send("ref", 9, 0, prompts, 2))  # both actors, weights 1
        victim = t.where(1)[0]
        os.kill(victim, signal.SIGSTOP)
        try:
            t.rollouts.send("again", 9, 0, prompts, 2)  # queued behind the stop, sent with weights 1
            grpo_step(t, progress, 2)  # weights 2 queued behind it too
        finally:
            os.kill(victim, signal.SIGKILL)
        t.rollouts.collect(t.rollouts.open["again"])
        assert t.store.get("again", ROLLOUT).equals(t.store.get("ref", ROLLOUT))
        assert set(t.store.get("again", ["generation_policy_version"]).column(0).to_pylist()) == {1}
        assert (t.ledger.actor_restarts, t.ledger.redispatched) == (1, 1) and t.where(1)[0] != victim
        m, _ = grpo_step(t, progress, 3)  # the replacement holds weights 2 now; step 3 was generated before the kill
        assert m["rollout/actor_restarts_total"] == 1 and m["rollout/rows_regenerated_total"] == 2
        assert len(t.ledger.faults) == 1 and t.ledger.faults[0]["where"]["pid"] == victim
    finally:
        t.close()


def test_the_budget_names_its_key_when_it_runs_out():
    from dataplane_rl.config import load_config as load
    from dataplane_rl.errors import ConfigError

    assert load(None, []).fault_tolerance.max_generation_failures == 3
    with pytest.raises(ConfigError, match="fault_tolerance.max_generation_failures"):
        load(None, ["fault_tolerance.max_generation_failures=-1"])


class Flaky:
    """A task whose reward raises ZeroDivisionError for the chosen prompts: the first `times` calls of each
    (prompt, response), or always (times=None). User code failing, so a hook is fair here."""

    def __init__(self, task, prompts, times):
        self.task, self.bad, self.times, self.calls = task, set(prompts), times, {}

    def __getattr__(self, name):
        return getattr(self.task, name)

    def raises(self, key) -> bool:
        n = self.calls[key] = self.calls.get(key, 0) + 1
        return key[0] in self.bad and (self.times is None or n <= self.times)

    def reward(self, prompt, response):
        if self.raises((prompt, response)):
            return 1 / 0
        return self.task.reward(prompt, response)


class FlakyEnv(Flaky):
    """A multi-turn task whose environment step raises instead, at every turn of the chosen prompts' episodes."""

    def step(self, prompt, actions):
        if self.raises((prompt, tuple(actions))):
            return 1 / 0
        return self.task.step(prompt, actions)


@pytest.mark.parametrize("task,flaky", [("count", Flaky), ("guess", FlakyEnv)])
def test_a_raising_reward_or_environment_is_retried_then_fails_its_whole_group(tmp_path, task, flaky):
    """Failing twice per call, within fault_tolerance.max_data_retries=2: the job's rows equal the clean job's.
    Failing always: the group's rows are never written (no zero reward, no empty row), the others are."""
    from dataplane_rl.schema import load_schema
    from dataplane_rl.store import open_store
    from test_multiturn import job, worker_for

    reason = "reward" if flaky is Flaky else "environment"
    w = worker_for(task)
    j = job(w, P=3)
    clean, receipt = w.generate(j)
    assert "data_retries" not in receipt and "failed_groups" not in receipt
    w.task = flaky(w.task, [j.prompts[1]], times=2)
    again, receipt = w.generate(j)
    assert again.equals(clean) and receipt["data_retries"][reason] >= 2 and "failed_groups" not in receipt
    store = open_store(f"shm://{tmp_path / 'store'}")
    try:
        G = w.cfg.grpo.num_generations_per_prompt
        store.create_partition(j.pid, load_schema("grpo"), 3 * G)
        w.io.close()
        from dataplane_rl.columns.actor_io import ActorIO

        w.io = ActorIO(store.url)
        w.task = flaky(w.task.task, [j.prompts[1]], times=None)
        table, receipt = w.generate(j)
        assert table is None
        [[group, why, error]] = receipt["failed_groups"]
        assert (group, why) == (1, reason) and error.startswith("ZeroDivisionError: division by zero"), receipt
        assert receipt["failed_rows"] == list(range(G, 2 * G)) and receipt["rows"] == 2 * G
        assert store.ready(j.pid, ["total_reward", "input_ids"]).tolist() == [*range(G), *range(2 * G, 3 * G)]
        others = [*range(G), *range(2 * G, 3 * G)]
        kept = store.get(j.pid, ["input_ids", "total_reward", "group_id"], others)
        assert kept.to_pylist() == clean.select(["input_ids", "total_reward", "group_id"]).take(pa.array(others)).to_pylist()
    finally:
        w.close()
        store.close()


def test_a_failed_group_is_left_out_and_replaced_then_the_budget_stops_the_run(tmp_path, ray_session):
    """In a run: a group whose reward always raises is named in one line, left out, and the step takes its place
    from a second round; the group past fault_tolerance.max_failed_groups stops the run, naming task, step,
    group and exception."""
    import sys

    import ray
    from ray import cloudpickle  # Ray's own copy pickles the calls

    from dataplane_rl.faults.data import DataFailureError
    from dataplane_rl.driver.fleet import Fleet
    from dataplane_rl.driver.step import grpo_step
    from dataplane_rl.run.progress import Progress

    cloudpickle.register_pickle_by_value(sys.modules[Flaky.__module__])  # the actors cannot import the tests folder
    cfg = load_config(None, ["grpo.num_prompts_per_step=2", "grpo.num_generations_per_prompt=2", "grpo.max_num_steps=2",
                             "policy.train_global_batch_size=4", "policy.train_micro_batch_size=2",
                             "generation.max_new_tokens=4", "data_plane.enabled=true", "task.name=count",
                             "fault_tolerance.max_failed_groups=1", f"logger.run_dir={tmp_path / 'run'}"])
    progress = Progress()
    t = Fleet(cfg, progress=progress)
    try:
        t.start()
        bad = [t.sampler.draw(cfg.grpo.seed, 1, 0, 2)[1], t.sampler.draw(cfg.grpo.seed, 2, 0, 2)[0]]

        def break_reward(actor):
            actor.task = Flaky(actor.task, bad, times=None)

        ray.get([a.__ray_call__.remote(break_reward) for a in t.actors()])
        m, samples = grpo_step(t, progress, 1)
        assert m["train/generation_rounds"] == 2 and m["rollout/failed_groups_total"] == 1
        assert m["rollout/data_retries_total/reward"] == 2 * 2  # the group's 2 rows, each tried 1 + 2 times
        assert {s["sample_id"].split("/")[0] for s in samples} == {"step-000001", "step-000001-r1"}
        assert not [s for s in samples if s["prompt"] == bad[0]] and all(np.isfinite([s["total_reward"] for s in samples]))
        [fault] = t.ledger.faults
        assert fault["where"] == {"task": "count", "partition": "step-000001", "group": 1}, fault
        with pytest.raises(DataFailureError, match=r"step 2: task 'count' group 0 \(partition step-000002\): its "
                                                   r"reward call raised ZeroDivisionError: division by zero on each of 3 "
                                                   r"tries .*max_failed_groups=1"):
            grpo_step(t, progress, 2)
    finally:
        t.close()


def test_a_dead_train_rank_is_named_with_its_node_and_the_key_that_would_have_saved_the_run(tmp_path, ray_session):
    """SIGKILL to train rank 1 of 2 (its PID from actors.json) after step 1, checkpointing off: one line names the
    rank, its PID and node and checkpointing.enabled; the rank's last output is in RUN_DIR/faults/. Rank 0's
    collective fails too when the dead rank's connection closes: the line names the dead rank (found by asking the
    ranks: faults/restart.py), not rank 0's gloo error."""
    import json
    import threading
    import time

    from dataplane_rl.driver.loop import train
    from dataplane_rl.faults.train_ranks import TrainRankError

    run_dir = tmp_path / "run"
    killed = []

    def kill_rank_after_step_1():
        deadline = time.monotonic() + 240
        metrics = run_dir / "metrics.jsonl"
        while not (metrics.is_file() and metrics.read_text()) and time.monotonic() < deadline:
            time.sleep(0.02)
        pid = json.loads((run_dir / "actors.json").read_text())["train"][1]["pid"]
        os.kill(pid, signal.SIGKILL)
        killed.append(pid)

    killer = threading.Thread(target=kill_rank_after_step_1, daemon=True)
    killer.start()
    with pytest.raises(TrainRankError, match=r"step [23]: train rank 1 \(pid \d+ on [0-9.]+\) died \(.*\); the run stops "
                                             r"here; its last output is in .*train-rank-1.log; checkpointing.enabled=true"):
        train(load_config(None, ["grpo.num_prompts_per_step=2", "grpo.num_generations_per_prompt=2",
                                 "grpo.max_num_steps=3", "policy.train_global_batch_size=4",
                                 "policy.train_micro_batch_size=2", "generation.max_new_tokens=4", "logger.progress=false",
                                 "policy.dp_size=2",
                                 f"logger.run_dir={run_dir}"]))
    killer.join(timeout=60)
    assert killed and f"pid {killed[0]} " in json.loads((run_dir / "summary.json").read_text())["error"]
    log = (run_dir / "faults" / "train-rank-1.log").read_text()
    assert log.startswith(f"train rank 1, pid {killed[0]}\n==> ") and f"-{killed[0]}.err" in log, log[:500]


def test_calls_to_several_ranks_fail_at_the_first_that_fails_not_in_list_order(ray_session):
    """ray_calls.get_all: the second call's error is raised while the first is still running (ray.get(list) would wait
    for the first: a train rank waiting in a collective for a dead one, until gloo's 10-minute timeout)."""
    import ray

    from dataplane_rl.ray_calls import get_all

    @ray.remote(num_cpus=0)
    class Rank:
        def run(self, fail: bool, seconds: float):
            import time

            if fail:
                raise ValueError("rank failed")
            time.sleep(seconds)
            return seconds

    slow, failing = Rank.remote(), Rank.remote()
    try:
        calls = [slow.run.remote(False, 120), failing.run.remote(True, 0)]
        with pytest.raises(ray.exceptions.RayTaskError, match="rank failed"):
            get_all(calls)
        assert ray.wait(calls[:1], timeout=0)[0] == [], "get_all waited for the slow call before raising"
    finally:
        for a in (slow, failing):
            ray.kill(a)


def test_a_restart_past_its_budget_or_without_a_checkpoint_ends_the_run_with_its_error(tmp_path):
    """faults/restart.py's refusals (the decision alone; the recoveries themselves are tested with real kills in
    test_async_grpo.py): a dead holder whose rows cannot be made again in the step needs a checkpoint, and
    fault_tolerance.max_restarts=N stops the N+1-th restart with the error the first would have stopped with."""
    from types import SimpleNamespace

    from dataplane_rl.run.ledger import FaultKind
    from dataplane_rl.faults.restart import Fault, RunRestarts
    from dataplane_rl.run.ledger import FaultLedger
    from dataplane_rl.errors import StoreUnavailableError

    from dataplane_rl.run.progress import Progress

    def trainer(ahead, trained):  # (the train group, the run's progress) as refusal() takes them
        return SimpleNamespace(generates_ahead=lambda: ahead is not None), Progress(trained=trained)

    holder = Fault(FaultKind.STORE_HOLDER_DIED, {"store": "mooncake://127.0.0.1:1"}, "Mooncake holder 1 (pid 7) exited", None,
                   "Mooncake holder 1 (pid 7) exited with code -9")
    r = RunRestarts(load_config(None, ["checkpointing.enabled=false"]), tmp_path, None, FaultLedger())
    assert r.refusal(*trainer(None, False), holder, 2, None) is None  # sync, before the optimizer steps: regenerated
    assert r.refusal(*trainer(None, True), holder, 2, None, step_trained=True) is None  # the step returned: goes on
    for t in (trainer(1, False), trainer(None, True)):  # async rows, or the weights already stepped
        err = r.refusal(*t, holder, 2, None)
        assert isinstance(err, StoreUnavailableError) and "step 2: Mooncake holder 1 (pid 7)" in str(err)
        assert "checkpointing.enabled=true would have let the run resume" in str(err)
    r = RunRestarts(load_config(None, ["checkpointing.enabled=true", "fault_tolerance.max_restarts=1"]), tmp_path, None, FaultLedger())
    assert r.refusal(*trainer(1, False), holder, 3, 2) is None  # resumes from checkpoint 2
    assert "no checkpoint was saved yet" in str(r.refusal(*trainer(1, False), holder, 1, None))
    r.ledger.store_restarts = 1
    err = r.refusal(*trainer(None, False), holder, 4, 2)
    assert "fault_tolerance.max_restarts=1: the run restarted 1 time(s) already" in str(err)


def test_a_store_lost_after_an_on_policy_step_trained_costs_only_what_it_held(tmp_path, capsys, ray_session):
    """An on-policy step writes its train forward's prev_logprobs (and its rollouts file) after the optimizer step,
    when its rows can no longer be made again: a holder that died then took them with the step's rows, so the step
    goes on with one line saying so (as its partition's drop does); a store error of a live store still raises.
    The dead holder is stood in for: no real kill lands between the optimizer step and that write on purpose."""
    from types import SimpleNamespace

    from dataplane_rl.driver.step import prev_from_train
    from dataplane_rl.driver.step_io import StepIO
    from dataplane_rl.errors import StoreUnavailableError

    def send(method, jobs, fields=None):
        assert method == "emit_prev_logprobs" and fields is None
        raise StoreUnavailableError("partition step-000003: put failed: the Mooncake holder is unreachable")

    def fleet(dead):
        return SimpleNamespace(store=SimpleNamespace(dead_processes=lambda: dead), send=send, call_ranks=lambda m: [])

    io = StepIO()
    prev_from_train(fleet(["Mooncake holder 1 (pid 7) exited with code -9"]), 3, [], [[]], io, tmp_path)
    assert "step 3: the run's store lost a process after the optimizer step" in capsys.readouterr().err
    assert "prev_logprobs" in io.timing and not list(tmp_path.iterdir())
    with pytest.raises(StoreUnavailableError, match="holder is unreachable"):
        prev_from_train(fleet(None), 3, [], [[]], StepIO(), tmp_path)  # shm: no process of its own died, so the error stands


def test_a_step_logged_again_replaces_its_earlier_line_in_the_summary(tmp_path):
    """The last line of a step counts: a step run again after an in-run resume (and the steps after it) replace the
    lines before them in summary.json's steps and final metrics."""
    from dataplane_rl.run.folder import RunDir

    run = RunDir(tmp_path / "run")
    run.begin("{}\n")
    for step, reward in [(1, 0.1), (2, 0.2), (3, 0.3), (2, 0.25), (3, 0.35), (4, 0.4)]:
        run.log_step({"step": step, "train/reward": reward, "train/loss": 0.0}, [])
    assert [(m["step"], m["train/reward"]) for m in run.metrics] == [(1, 0.1), (2, 0.25), (3, 0.35), (4, 0.4)]
    assert len((tmp_path / "run" / "metrics.jsonl").read_text().splitlines()) == 6  # every line is kept
    run.close()


def _reading_rank(rank: int, rendezvous: str, out: str) -> None:
    """One of two gloo ranks reading with TrainWorker._read_together: rank 1's read fails first, then both read."""
    import json
    from types import SimpleNamespace

    import torch.distributed as dist

    from dataplane_rl.bench.train import synthetic_table
    from dataplane_rl.errors import StoreUnavailableError
    from dataplane_rl.schema import load_schema
    from dataplane_rl.train.batch import build_train_batch
    from dataplane_rl.train.worker import TrainWorker
    from ranks import leave

    dist.init_process_group("gloo", init_method=f"file://{rendezvous}", rank=rank, world_size=2)
    try:
        me = SimpleNamespace(cfg=load_config(None, ["policy.train_micro_batch_size=2"]), world=2, rank=rank)
        schema = load_schema("grpo")
        rows = 2 if rank == 0 else 6  # rank 1 has 3 microbatches of 2, rank 0 one: rank 0 adds 2 empty passes

        def read(fail: bool):
            if fail:
                raise StoreUnavailableError("partition step-000001: a Mooncake holder is unreachable")
            return [build_train_batch(synthetic_table(np.full(rows, 12), vocab=50, seed=rank), schema, "cpu")]

        seen = []
        for fail in (rank == 1, False):
            try:
                batches, plans, extras = TrainWorker._read_together(me, lambda: read(fail), "train", 1)
                seen.append({"microbatches": [len(p) for p in plans], "extras": extras})
            except StoreUnavailableError as e:
                seen.append({"error": str(e)})
        with open(f"{out}-{rank}.json", "w") as f:
            json.dump(seen, f)
    finally:
        dist.destroy_process_group()
    leave()  # not through the interpreter's exit, whose C++ destructors abort a gloo rank now and then


def test_train_ranks_agree_on_their_reads_before_any_collective(tmp_path):
    """A rank whose read of the step's rows fails (a lost holder) tells the others in the all-reduce that evens their
    passes, the one they make anyway: both ranks raise at once, none waits in a collective for the other until
    gloo's timeout, and the next read on both goes on (the pass counts are still evened)."""
    import json

    import torch.multiprocessing as mp

    out = str(tmp_path / "rank")
    mp.spawn(_reading_rank, args=(str(tmp_path / "rendezvous"), out), nprocs=2, join=True)
    zero, one = (json.loads(open(f"{out}-{r}.json").read()) for r in (0, 1))
    assert zero[0] == {"error": "train rank 0: another rank could not read its rows of this step (its error is the one "
                                "the driver reports)"}
    assert one[0] == {"error": "partition step-000001: a Mooncake holder is unreachable"}
    assert zero[1] == {"microbatches": [1], "extras": [2]} and one[1] == {"microbatches": [3], "extras": [0]}
