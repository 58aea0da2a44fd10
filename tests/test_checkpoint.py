"""Checkpoints, resume and export with real processes: kill -9 the driver, resume, compare every step.

Straight runs go in-process on the session's Ray; the killed runs are CLI subprocesses (kill -9 needs one).
"""

from __future__ import annotations

import json
import math
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pyarrow as pa
import pytest
import torch

from dataplane_rl.config import dump_config, load_config
from dataplane_rl.errors import ConfigError
from test_train_e2e import overriding

# 4 prompts x 4 samples = 16 rows; 2 optimizer steps per rollout step; checkpoints at steps 2 and 3 (the last)
TINY = ["grpo.num_prompts_per_step=4", "grpo.num_generations_per_prompt=4", "grpo.max_num_steps=3",
        "policy.train_global_batch_size=8", "policy.train_micro_batch_size=4", "generation.max_new_tokens=6",
        "logger.progress=false", "checkpointing.enabled=true", "checkpointing.save_period=2",
        "checkpointing.keep_top_k=null"]
# the guess task's multi-turn rows (docs/multiturn.md): one token per guess, observations between the turns
MULTI_TURN = ("task.name=guess", "generation.max_new_tokens=1", "policy.max_total_sequence_length=48",
              "multi_turn.max_turns=3")
KEYS = ("train/loss", "train/pg_loss", "train/kl_penalty", "train/clip_fraction", "train/grad_norm",
        "train/global_valid_toks", "train/reward", "train/probs_ratio_mean", "train/approx_entropy",
        "train/logprob_mismatch")


def straight_run(run_dir: Path, *overrides: str) -> list[dict]:
    from dataplane_rl.driver.loop import train

    summary = train(load_config(None, [*TINY, f"logger.run_dir={run_dir}", *overrides]))
    assert summary["status"] == "completed"
    return read_metrics(run_dir)


def read_metrics(run_dir: Path) -> list[dict]:
    return [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]


def cli(*args, timeout=300):
    return subprocess.run([sys.executable, "-m", "dataplane_rl.cli.main", *args], capture_output=True, text=True,
                          timeout=timeout)


def wait_for(proc: subprocess.Popen, ready, what: str, timeout: float = 240, poll: float = 0.05) -> None:
    """Bounded wait that fails at once when the child dies first."""
    deadline = time.monotonic() + timeout
    while not ready():
        if proc.poll() is not None:
            pytest.fail(f"the run exited ({proc.returncode}) before {what}: {proc.stdout.read()[-3000:]}")
        if time.monotonic() > deadline:
            proc.kill()
            pytest.fail(f"no {what} after {timeout}s")
        time.sleep(poll)


def descendants(pid: int) -> list[int]:
    import psutil

    return [c.pid for c in psutil.Process(pid).children(recursive=True)]


def kill_after_checkpoint(run_dir: Path, step: int, *overrides: str, shared: Path | None = None) -> None:
    """Start a CLI run, kill -9 its driver once checkpoint `step` is complete, reap what it started. shared: the
    run's checkpointing.checkpoint_dir, where its checkpoints go in a folder of the run's own."""
    import psutil

    proc = subprocess.Popen([sys.executable, "-m", "dataplane_rl.cli.main", "train",
                             *overriding(TINY, f"logger.run_dir={run_dir}", *overrides,
                                         *([f"checkpointing.checkpoint_dir={shared}"] if shared else []))],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    name = f"step_{step:06d}"
    done = (lambda: any(shared.glob(f"*/{name}"))) if shared else (run_dir / "checkpoints" / name).is_dir
    wait_for(proc, done, f"checkpoint {name}")
    kids = descendants(proc.pid)
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait(timeout=30)
    # Ray's processes share the driver's fate; any that linger are ours (we started them): kill by PID
    _, alive = psutil.wait_procs([psutil.Process(k) for k in kids if psutil.pid_exists(k)], timeout=30)
    for p in alive:
        p.kill()
    proc.stdout.close()
    assert not (run_dir / "summary.json").exists(), "a kill -9 leaves no summary"


def assert_same_steps(a: list[dict], b: list[dict], rel: float = 1e-5) -> None:
    assert [m["step"] for m in a] == [m["step"] for m in b] == list(range(1, len(a) + 1))
    for x, y in zip(a, b):
        for k in KEYS:
            assert math.isclose(x[k], y[k], rel_tol=rel, abs_tol=1e-7), f"step {x['step']} {k}: {x[k]} vs {y[k]}"


@pytest.fixture(scope="module")
def straight(tmp_path_factory, ray_session) -> tuple[Path, list[dict]]:
    run_dir = tmp_path_factory.mktemp("ckpt") / "straight"
    return run_dir, straight_run(run_dir)


def test_kill_9_then_resume_on_two_ranks_with_the_data_plane_on(straight, tmp_path):
    """Elastic dp 1->2, and the data plane switched on (portability): only the reduction order changes.
    The killed run, of the straight run's YAML, saves into the straight run's checkpoint folder (two runs of a
    sweep sharing checkpointing.checkpoint_dir): in a folder of its own, never replacing the straight run's
    step_000002 (it once did, and a resume of either then continued the other's weights)."""
    from dataplane_rl.checkpoint.files import damage
    from dataplane_rl.checkpoint.identity import read_run_id

    straight_dir, expected = straight
    shared = straight_dir / "checkpoints"
    before = {p.name: (p / "manifest.json").read_bytes() for p in shared.glob("step_*")}
    run_dir = tmp_path / "killed"
    kill_after_checkpoint(run_dir, 2, shared=shared)
    own = shared / read_run_id(run_dir)
    assert [p.name for p in own.iterdir()] == ["step_000002"] and not (run_dir / "checkpoints").exists()
    latest = max(int(c.name.split("_")[1]) for c in own.glob("step_*"))
    p = cli("train", "--resume", str(run_dir), "logger.progress=false", "policy.dp_size=2", "data_plane.enabled=true")
    assert p.returncode == 0, p.stderr[-3000:]
    assert f"resumed {run_dir} from its checkpoint of step {latest}" in p.stderr, p.stderr[-3000:]
    assert sorted(c.name for c in own.iterdir()) == ["step_000002", "step_000003"]
    assert {c.name: (c / "manifest.json").read_bytes() for c in shared.glob("step_*")} == before
    for c in shared.glob("step_*"):  # the straight run's, whole and still recording it
        assert damage(c) is None
        assert json.loads((c / "driver.json").read_text())["run"]["id"] == read_run_id(straight_dir)
    from dataplane_rl.checkpoint.export import export_run

    assert export_run(run_dir, tmp_path / "hf")[1] == 3  # export finds the run's own folder of the shared one
    got = read_metrics(run_dir)
    assert_same_steps(got, expected, rel=1e-4)  # no step twice, none missing, same numbers
    assert got[-1]["data_plane/enabled"] and not expected[-1]["data_plane/enabled"]
    assert sorted(f.name for f in (run_dir / "train_data").iterdir()) == [f"step_{i:06d}.jsonl" for i in range(1, 4)]
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["status"] == "completed" and summary["steps_completed"] == 3
    assert (run_dir / "policy" / "model.safetensors").is_file()


def kill_rollout_actors(run_dir: Path, kills: list[tuple], *overrides: str) -> tuple[int, str]:
    """Start a CLI run (data plane on) and, for each (when, slot) in order, SIGKILL the rollout actor on `slot` by
    the PID the run recorded in actors.json: a real external kill. when=N: once metrics.jsonl holds N lines.
    when="start": SIGSTOP it as soon as actors.json appears, SIGKILL it once step 1's partition exists, so it
    dies with its step-1 job sent and unfinished (a tiny model generates a job in ~30 ms: a kill after a
    metrics line finds no job in flight). Returns (exit code, output)."""
    proc = subprocess.Popen([sys.executable, "-m", "dataplane_rl.cli.main", "train",
                             *overriding(TINY, f"logger.run_dir={run_dir}", *overrides)],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    metrics, actors = run_dir / "metrics.jsonl", run_dir / "actors.json"
    try:
        for when, slot in kills:
            if when == "start":
                wait_for(proc, actors.is_file, "actors.json", poll=0.002)
                pid = json.loads(actors.read_text())["rollout"][slot]["pid"]
                os.kill(pid, signal.SIGSTOP)
                store = Path(json.loads((run_dir / "store.json").read_text())["store_url"][len("shm://"):])
                wait_for(proc, (store / "step-000001").exists, "step 1's partition")
                time.sleep(0.2)  # the driver sends the jobs right after it makes the partition
            else:
                wait_for(proc, lambda: metrics.is_file() and len(metrics.read_text().splitlines()) >= when,
                         f"step {when}")
                pid = json.loads(actors.read_text())["rollout"][slot]["pid"]
            os.kill(pid, signal.SIGKILL)
        out, _ = proc.communicate(timeout=300)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    return proc.returncode, out


def train_rows(run_dir: Path) -> list[list[dict]]:
    return [[json.loads(x) for x in p.read_text().splitlines()] for p in sorted((run_dir / "train_data").iterdir())]


def test_rollout_actors_killed_mid_run_are_replaced_and_the_run_ends_the_same(straight, tmp_path):
    """Chaos: two rollout actors, each SIGKILLed once, the data plane on: one with its step-1 job unfinished, the
    other after step 2 (the run notices it at the checkpoint or the next call). Each is replaced on its slot, its
    unfinished jobs run again, and every step trains the same rows, to the same numbers, as the unkilled run."""
    straight_dir, expected = straight
    run_dir = tmp_path / "chaos"
    code, out = kill_rollout_actors(run_dir, [("start", 0), (2, 1)], "generation.num_workers=2",
                                    "data_plane.enabled=true")
    assert code == 0, out[-3000:]
    assert_same_steps(read_metrics(run_dir), expected)
    assert train_rows(run_dir) == train_rows(straight_dir), "the regenerated rows are the rows the run would have had"
    summary = json.loads((run_dir / "summary.json").read_text())
    faults = summary["faults"]
    assert [(f["what"], f["where"]["slot"]) for f in faults] == [("rollout actor died", 0), ("rollout actor died", 1)]
    assert out.count("died") >= 2 and "fault_tolerance.max_generation_failures: 2 of 3 used" in out, out[-3000:]
    last = read_metrics(run_dir)[-1]
    assert last["rollout/actor_restarts_total"] == 2
    assert last["rollout/redispatch_total"] == sum(f["cost"]["jobs_redispatched"] for f in faults)
    assert faults[0]["cost"]["jobs_redispatched"] == 1 and faults[0]["cost"]["rows_redispatched"] == 8, faults[0]
    assert faults[0]["step"] == 1 and last["rollout/rows_regenerated_total"] >= 8
    assert expected[-1]["rollout/actor_restarts_total"] == 0 and expected[-1]["rollout/redispatch_total"] == 0
    pids = [a["pid"] for a in json.loads((run_dir / "actors.json").read_text())["rollout"]]
    assert [f["where"]["pid"] for f in faults] != pids[:2] and len(set(pids)) == 2


def test_kill_9_then_resume_on_one_rank_and_one_rollout_actor(tmp_path, ray_session):
    """Elastic dp 2->1 and rollout actors 2->1 in one resume, on multi-turn rows: DCP reshards the two ranks'
    shards, and the episodes of the resumed steps are the straight run's."""
    from dataplane_rl.driver.loop import train
    from dataplane_rl.checkpoint.resume import resume_config

    from test_trace import assert_run_trace

    shape = ("policy.dp_size=2", "generation.num_workers=2", "data_plane.enabled=true", *MULTI_TURN)
    expected = straight_run(tmp_path / "straight2", *shape)
    two = ["driver", "rollout-0", "rollout-1", "train-rank-0", "train-rank-1"]
    assert_run_trace(tmp_path / "straight2", two, [1, 2, 3], checkpoints=True)  # every process's timeline
    run_dir = tmp_path / "killed2"
    # kill -9 skips the store's close: give the killed run a named shm folder that this test removes
    shm = Path("/dev/shm") / f"dataplane-rl-test-{os.getpid()}-{tmp_path.name}"
    try:
        kill_after_checkpoint(run_dir, 2, *shape, f"data_plane.backend=shm://{shm}")
        shards = list((run_dir / "checkpoints" / "step_000002" / "train").glob("*.distcp"))
        assert len(shards) == 2, "each rank writes its own shards"
        # a fresh store for the resumed run: the transport may change, the numbers do not
        summary = train(resume_config(run_dir, ["data_plane.backend=shm://", "policy.dp_size=1",
                                                "generation.num_workers=1"]), resume=True)
    finally:
        import shutil

        shutil.rmtree(shm, ignore_errors=True)
    assert summary["status"] == "completed" and len(summary["nodes"]["train"]) == 1
    # the killed run's trace.json (cut off by kill -9) continued by the resumed run of another shape; the
    # ranks' spans of the last save were still in the ranks when the driver died (docs/trace.md)
    doc = assert_run_trace(run_dir, two, [1, 2, 3])
    names = {e["name"] for e in doc["traceEvents"]}
    assert {"checkpoint", "checkpoint_load", "load_checkpoint"} <= names
    got = read_metrics(run_dir)
    assert_same_steps(got, expected, rel=1e-4)
    assert all(m["rollout/num_turns_mean"] > 1 for m in got), "multi-turn rows"
    for x, y in zip(got, expected):
        assert x["rollout/env_tokens_mean"] == y["rollout/env_tokens_mean"], x["step"]
    assert not Path(summary["store_url"][len("shm://"):]).exists()


def test_resume_refuses_a_number_changing_override(straight, tmp_path):
    from dataplane_rl.checkpoint.resume import resume_config

    run_dir, _ = straight
    for override, key in (("grpo.seed=1", "grpo.seed"), ("policy.train_global_batch_size=16", "policy.train_global_batch_size"),
                          ("loss_fn.ratio_clip_max=0.28", "loss_fn.ratio_clip_max")):
        with pytest.raises(ConfigError, match=key.replace(".", r"\.")):
            resume_config(run_dir, [override])
    cfg = resume_config(run_dir, ["grpo.max_num_steps=6", "policy.train_micro_batch_size=2"])  # allowed
    assert cfg.grpo.max_num_steps == 6
    p = cli("train", "--resume", str(run_dir), "grpo.seed=7")
    assert p.returncode == 2 and "grpo.seed" in p.stderr, p.stderr[-2000:]
    from dataplane_rl.driver.loop import train

    with pytest.raises(ConfigError, match="past grpo.max_num_steps=1"):
        train(resume_config(run_dir, ["grpo.max_num_steps=1"]), resume=True)
    (tmp_path / "empty").mkdir()
    (tmp_path / "empty" / "config.yaml").write_text(dump_config(load_config(None, TINY)))
    with pytest.raises(ConfigError, match="no complete checkpoint"):
        train(resume_config(tmp_path / "empty", []), resume=True)
    # the keys the run's own errors name as fixes change no number: a resume takes them
    fixes = ["data_plane.shm.arena_mb=1024", "data_plane.shm.prefault_mb=0", "fault_tolerance.max_restarts=5",
             "fault_tolerance.max_generation_failures=9", "fault_tolerance.max_data_retries=4",
             "fault_tolerance.max_failed_groups=20", "grpo.async_grpo.wait_timeout_s=60", "grpo.max_gen_batches=9",
             "grpo.val_period=0", "grpo.val_at_start=false"]
    assert resume_config(run_dir, fixes).fault_tolerance.max_restarts == 5


def test_resume_refuses_another_runs_checkpoint_naming_both(straight, tmp_path):
    """Another run's checkpoint in this run's checkpoint folder (copied, or a sweep's runs sharing one before they
    had a folder each): refused before Ray starts, naming both runs, unless --accept-mismatch."""
    import shutil

    from dataplane_rl.checkpoint.identity import CheckpointMismatchError, read_run_id
    from dataplane_rl.checkpoint.resume import resume_config
    from dataplane_rl.driver.loop import train

    run_dir, _ = straight
    other = tmp_path / "other"
    (other / "checkpoints").mkdir(parents=True)
    shutil.copy(run_dir / "config.yaml", other / "config.yaml")
    (other / "run.json").write_text('{"run_id": "other-0123abcd"}\n')
    shutil.copytree(run_dir / "checkpoints" / "step_000003", other / "checkpoints" / "step_000003")
    summary = (run_dir / "summary.json").read_bytes()
    with pytest.raises(CheckpointMismatchError) as e:
        train(resume_config(other, []), resume=True)
    line = str(e.value)
    assert "\n" not in line and f"saved by run {read_run_id(run_dir)} (in {run_dir})" in line, line
    assert "this run other-0123abcd" in line and f"--resume {run_dir}" in line and "--accept-mismatch" in line, line
    assert sorted(p.name for p in other.iterdir()) == ["checkpoints", "config.yaml", "run.json"], "refused: untouched"
    with pytest.raises(ConfigError, match="past grpo.max_num_steps=2"):  # told: on to the next check
        train(resume_config(other, ["grpo.max_num_steps=2"]), resume=True, accept_mismatch=True)
    assert (run_dir / "summary.json").read_bytes() == summary


def test_a_checkpoint_record_names_what_differs(tmp_path, capsys):
    """What a resume compares (checkpoint/identity.py), each difference one line naming both sides: another run,
    a value the numbers depend on, and a data file rewritten in place (task.path keeps its name, its cached
    Arrow copy would follow the new bytes); a checkpoint without a record; --accept-mismatch only warns."""
    from dataplane_rl.checkpoint.identity import CheckpointMismatchError, check, record

    data = tmp_path / "math.jsonl"
    data.write_text('{"question": "1+1", "answer": "2"}\n')
    cfg = load_config(None, ["task.name=math_jsonl", f"task.path={data}", f"logger.run_dir={tmp_path / 'run'}"])
    saved = record(cfg, "run-1", tmp_path / "run")
    assert saved["config"]["task.path"] == str(data) and "grpo.max_num_steps" not in saved["config"]
    assert check(cfg, tmp_path, 2, saved, "run-1") == saved["data"]  # its own run: no complaint
    cases = {"another run": ({**saved, "id": "run-2"}, "saved by run run-2"),
             "no record": (None, "records no run"),
             "a value": ({**saved, "config": {**saved["config"], "grpo.seed": 7}},
                         f"grpo.seed=7, and this run has {cfg.grpo.seed}")}
    for what, (rec, words) in cases.items():
        with pytest.raises(CheckpointMismatchError, match=words):
            check(cfg, tmp_path, 2, rec, "run-1")
    data.write_text('{"question": "1+1", "answer": "3"}\n')  # rewritten: same name, same size
    with pytest.raises(CheckpointMismatchError) as e:
        check(cfg, tmp_path, 2, saved, "run-1")
    assert f"trained on task.path={data} with xxh3 {saved['data']['task.path']}, and its contents have changed (xxh3 " \
        in str(e.value)
    now = check(cfg, tmp_path, 2, saved, "run-1", accept=True)
    assert now["task.path"] != saved["data"]["task.path"] and "warning: " in capsys.readouterr().err


@pytest.fixture
def failing_saver(ray_session):
    """A train rank whose save writes its shards and then dies: the fault a crash mid-save leaves."""
    import ray
    import torch.distributed.checkpoint as dcp

    @ray.remote(num_cpus=0)
    class Saver:
        def save_checkpoint(self, path):
            dcp.save({"x": torch.arange(1000.0)}, checkpoint_id=path, no_dist=True)
            raise RuntimeError("crashed in the middle of the save")

    actor = Saver.remote()
    yield actor
    ray.kill(actor)


def test_a_crash_mid_save_keeps_the_previous_checkpoint(straight, failing_saver, tmp_path):
    import shutil
    import types

    import ray

    from dataplane_rl.checkpoint.manager import CheckpointManager, step_of
    from dataplane_rl.checkpoint.export import export_run

    run_dir = tmp_path / "crash"
    shutil.copytree(straight[0], run_dir)
    manager = CheckpointManager(run_dir / "checkpoints")
    fleet = types.SimpleNamespace(call_ranks=lambda method, *args: ray.get(getattr(failing_saver, method).remote(*args)))
    with pytest.raises(ray.exceptions.RayTaskError, match="middle of the save"):
        manager.save(fleet, 6, "")
    # a failed save removes what it wrote (a full disk needs the room back); a killed driver's stays behind
    assert not (run_dir / "checkpoints" / ".step_000006.tmp").exists(), "the failed save left its partial folder"
    partial = run_dir / "checkpoints" / ".step_000006.tmp" / "train"
    partial.mkdir(parents=True)
    (partial / "__0_0.distcp").write_bytes(b"half a shard")
    assert step_of(manager.find()) == 3, "the partial save must not be visible"
    _, step = export_run(run_dir, tmp_path / "from_previous")  # and the previous one still loads
    assert step == 3 and (tmp_path / "from_previous" / "model.safetensors").is_file()


def trainer_logprobs(run_dir: Path, step: int, ids: list[list[int]]) -> np.ndarray:
    """prev_logprobs from a real train worker (one rank) restored from checkpoint `step`."""
    from dataplane_rl.checkpoint.manager import CheckpointManager
    from dataplane_rl.model.load import resolve_model
    from dataplane_rl.train.worker import TrainWorker

    cfg = load_config(run_dir / "config.yaml")
    w = TrainWorker(cfg.model_dump(mode="json", by_alias=True),
                    str(resolve_model(cfg.policy.model, cfg.grpo.seed, cfg.policy.model_cache_dir)), None, 0, 1, 1)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    w.init_dist(f"tcp://127.0.0.1:{port}")
    try:
        w.load_checkpoint(str(CheckpointManager.for_config(cfg).find(step) / "train"))
        lengths = [len(x) for x in ids]
        table = pa.table({"input_ids": pa.array(ids, pa.list_(pa.int32())), "input_lengths": pa.array(lengths, pa.int32()),
                          "token_mask": pa.array([[0] + [1] * (n - 1) for n in lengths], pa.list_(pa.int8()))})
        out = w.logprobs([("p", np.arange(len(ids)))], table)
        return np.concatenate(out.column("prev_logprobs").to_pylist())
    finally:
        w.close()


def assert_export_is_the_final_policy(run_dir: Path, out: Path) -> None:
    """A completed run's export of its last checkpoint holds exactly the weights of its own policy/ folder."""
    from safetensors.torch import load_file

    final, exported = load_file(run_dir / "policy" / "model.safetensors"), load_file(out / "model.safetensors")
    assert final.keys() == exported.keys() and all(torch.equal(final[k], exported[k]) for k in final)


def test_export_loads_in_transformers_with_the_trainers_logprobs(straight, tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    run_dir, _ = straight
    out = tmp_path / "hf"
    p = cli("export", str(run_dir), "--step", "3", str(out))
    assert p.returncode == 0, p.stderr[-3000:]
    assert "model shards" not in p.stderr and "%|" not in p.stderr, p.stderr  # no transformers progress bar
    for f in ("config.json", "model.safetensors", "tokenizer.json"):
        assert (out / f).is_file(), f
    model = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    tok = AutoTokenizer.from_pretrained(out)
    ids = [[tok.bos_token_id, *tok("abc abc", add_special_tokens=False).input_ids],
           [tok.bos_token_id, *tok("12+3=", add_special_tokens=False).input_ids]]
    expected = []
    with torch.no_grad():
        for row in ids:
            logits = model(torch.tensor([row])).logits[0]  # [T, V]
            logp = torch.log_softmax(logits[:-1], -1).gather(-1, torch.tensor(row[1:])[:, None])[:, 0]  # [T-1]
            expected.append(np.concatenate([[0.0], logp.numpy()]))
    np.testing.assert_allclose(trainer_logprobs(run_dir, 3, ids), np.concatenate(expected), rtol=1e-5, atol=1e-6)
    assert_export_is_the_final_policy(run_dir, out)
    assert cli("export", str(run_dir), "--step", "1", str(tmp_path / "no")).returncode == 2  # no such step
    again = cli("export", str(run_dir), str(out))
    assert again.returncode == 2 and "not empty" in again.stderr  # never overwrites a folder


def test_an_exported_model_trains_as_policy_model(straight, tmp_path):
    run_dir, _ = straight
    from dataplane_rl.driver.loop import train

    summary = train(load_config(None, [*TINY, "grpo.max_num_steps=1", "checkpointing.enabled=false",
                                       "grpo.num_prompts_per_step=2", "policy.train_global_batch_size=4",
                                       f"policy.model={run_dir / 'policy'}", f"logger.run_dir={tmp_path / 'again'}"]))
    assert summary["status"] == "completed" and summary["steps_completed"] == 1


def test_an_exported_policy_teaches_a_distilled_student(straight, tmp_path):
    """On-policy distillation (docs/distillation.md) from the straight run's exported policy/, data plane on: the
    train workers write the teacher's top-k as shaped columns through the store and train on the KL beside the
    GRPO loss. distillation.topk_logits_k=16 is the whole change for the tiny vocabulary (53, under the default
    k = 64): the built-in schema's teacher columns are [distillation.topk_logits_k], bound to the run's 16."""
    from dataplane_rl.driver.loop import train

    run_dir, _ = straight
    out = tmp_path / "distilled"
    summary = train(load_config(None, [*TINY, "grpo.max_num_steps=2", "checkpointing.enabled=false",
                                       "distillation.enabled=true", f"distillation.teacher={run_dir / 'policy'}",
                                       "distillation.topk_logits_k=16", "distillation.kl_type=mixed",
                                       "distillation.task_loss_weight=0.5",
                                       "data_plane.enabled=true", f"logger.run_dir={out}"]))
    assert summary["status"] == "completed" and summary["steps_completed"] == 2
    for m in read_metrics(out):
        kl = m["train/distillation_loss"]
        assert 0 < kl < 10 and math.isclose(m["train/loss"], kl + 0.5 * m["train/task_loss"], rel_tol=1e-5, abs_tol=1e-7)
        assert 0 < m["train/distillation_student_topk_mass"] < 1 and 0 < m["train/distillation_teacher_topk_mass"] <= 1
        # the teacher's two [16] columns alone are 128 bytes per token, and every trained token has them
        assert m["data_plane/bytes_written"] > 128 * m["train/global_valid_toks"]


def test_bfloat16_is_refused_on_cpu():
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from dataplane_rl.train.fsdp import shard

    model = Qwen2ForCausalLM(Qwen2Config(hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                         num_attention_heads=2, num_key_value_heads=1, vocab_size=32))
    with pytest.raises(ConfigError, match="policy.precision=float32"):
        shard(model, None, torch.device("cpu"), "bfloat16")


def test_reopen_drops_the_steps_after_the_checkpoint(tmp_path):
    """A kill after checkpoint 2 may leave step 3 logged and a half-written step-4 line: both go."""
    from dataplane_rl.run.folder import RunDir

    (tmp_path / "train_data").mkdir()
    lines = [json.dumps({"step": i, "train/reward": 0.1 * i}) for i in (1, 2, 3)]
    (tmp_path / "metrics.jsonl").write_text("\n".join(lines) + '\n{"step": 4, "train/rew')
    for i in (1, 2, 3):
        (tmp_path / "train_data" / f"step_{i:06d}.jsonl").write_text("{}\n")
    (tmp_path / "config.yaml").write_text("grpo: {}\n")
    run = RunDir(tmp_path, resume=True)
    run.resume_from("grpo: {}\n", 2)
    run.close()
    assert [m["step"] for m in run.metrics] == [1, 2]
    assert (tmp_path / "metrics.jsonl").read_text() == "".join(x + "\n" for x in lines[:2])
    assert sorted(p.name for p in (tmp_path / "train_data").iterdir()) == ["step_000001.jsonl", "step_000002.jsonl"]


# -- checkpoints load no code and verify their bytes -------------------------------------------------------
class Payload:
    """A pickle that, when loaded by an unrestricted unpickler, creates the file `marker`."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def plant_in_dcp_item(train: Path, payload: Payload) -> str:
    """Point one non-tensor DCP item (the scheduler's step count) at a torch.save'd payload appended to its
    .distcp file; returns that file's name. The test's own metadata, so plain pickle reads it here."""
    import io
    import pickle

    md = pickle.loads((train / ".metadata").read_bytes())
    key = next(k for k in md.storage_data if k.fqn == "scheduler.last_epoch")
    info = md.storage_data[key]
    buf = io.BytesIO()
    torch.save(payload, buf)
    shard = train / info.relative_path
    offset = shard.stat().st_size
    with open(shard, "ab") as f:
        f.write(buf.getvalue())
    info.offset, info.length = offset, len(buf.getvalue())
    (train / ".metadata").write_bytes(pickle.dumps(md))
    return info.relative_path


@pytest.fixture
def run_copy(straight, tmp_path) -> Path:
    import shutil

    run_dir = tmp_path / "copy"
    shutil.copytree(straight[0], run_dir)
    return run_dir


def test_a_crafted_pickle_in_any_checkpoint_file_never_runs(run_copy, tmp_path):
    """A __reduce__ payload in each file a resume or an export reads, with the manifest re-signed so
    only the loaders stand between it and os.system: refused naming the file, and the marker never appears."""
    import pickle
    import shutil

    from dataplane_rl.checkpoint.files import CheckpointError, write_manifest
    from dataplane_rl.driver.loop import train
    from dataplane_rl.checkpoint.resume import resume_config

    marker = tmp_path / "pwned"
    ckpt = run_copy / "checkpoints" / "step_000003"
    pristine = tmp_path / "pristine"
    shutil.copytree(ckpt, pristine)
    for target in ("train/.metadata", "train/distcp-item", "driver.json", "manifest.json"):
        shutil.rmtree(ckpt)
        shutil.copytree(pristine, ckpt)
        if target == "train/distcp-item":
            named = "train/" + plant_in_dcp_item(ckpt / "train", Payload(marker))
        else:
            named = target
            (ckpt / target).write_bytes(pickle.dumps(Payload(marker)))
        if target != "manifest.json":
            write_manifest(ckpt, 3)
        with pytest.raises(CheckpointError) as e:
            train(resume_config(run_copy, []), resume=True)
        assert Path(named).name in str(e.value) and "\n" not in str(e.value), (target, str(e.value))
        assert not marker.exists(), f"the payload in {target} ran on resume"
        if target == "train/.metadata":  # the reported reproduction: export, in a subprocess
            p = cli("export", str(run_copy), str(tmp_path / "out"))
            assert p.returncode == 2 and p.stderr.count("\n") == 1 and ".metadata" in p.stderr, p.stderr[-2000:]
            assert p.stderr.startswith("error:") and not marker.exists()
    assert not (tmp_path / "out").exists()


def test_damaged_checkpoint_files_are_refused_by_name(run_copy, tmp_path):
    """Flipped, truncated and deleted files, and a missing manifest: one line naming the file and the step,
    offering the newest checkpoint that verifies; nothing is loaded and the run folder is untouched."""
    from dataplane_rl.checkpoint.files import CheckpointError
    from dataplane_rl.checkpoint.export import export_run
    from dataplane_rl.driver.loop import train
    from dataplane_rl.checkpoint.resume import resume_config

    ckpt = run_copy / "checkpoints" / "step_000003"
    shard = max((ckpt / "train").glob("*.distcp"), key=lambda p: p.stat().st_size)
    summary = (run_copy / "summary.json").read_bytes()
    data = bytearray(shard.read_bytes())
    for i in range(0, len(data), 65536):
        data[i] ^= 0xFF
    shard.write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match=rf"checkpoint step 3 .*train/{shard.name} has changed bytes.*"
                                              r"newest complete checkpoint is step 2"):
        export_run(run_copy, tmp_path / "out")
    with pytest.raises(CheckpointError, match=rf"train/{shard.name} has changed bytes"):
        train(resume_config(run_copy, []), resume=True)
    assert (run_copy / "summary.json").read_bytes() == summary
    shard.write_bytes(bytes(data[: len(data) // 2]))
    p = cli("export", str(run_copy), str(tmp_path / "out"))
    assert p.returncode == 2 and p.stderr.count("\n") == 1, p.stderr[-2000:]
    assert f"train/{shard.name} is truncated" in p.stderr and "step 3" in p.stderr and "step 2" in p.stderr
    shard.unlink()
    with pytest.raises(CheckpointError, match=rf"train/{shard.name} is missing"):
        export_run(run_copy, tmp_path / "out")
    (run_copy / "checkpoints" / "step_000002" / "manifest.json").unlink()
    with pytest.raises(CheckpointError, match=r"step 2 .*manifest.json is missing.*no other checkpoint"):
        export_run(run_copy, tmp_path / "out", 2)
    assert not (tmp_path / "out").exists()


def test_a_remote_error_is_one_line_and_its_traceback_goes_to_the_run_folder(tmp_path, ray_session):
    import ray

    from dataplane_rl.errors import ConfigError as Err
    from dataplane_rl.run.folder import RunDir

    @ray.remote(num_cpus=0)
    def fails():
        raise Err("partition step-000002 column 'advantages' rows 0-3: the remote reason")

    with pytest.raises(ray.exceptions.RayTaskError) as e:
        ray.get(fails.remote())
    assert "\n" in str(e.value), "Ray's own text carries the remote traceback"
    run = RunDir(tmp_path / "run")
    run.begin("grpo: {}\n")
    line = run.record_error(e.value)
    summary = run.finish("failed", line)
    run.close()
    assert summary["error"] == json.loads((tmp_path / "run" / "summary.json").read_text())["error"] == line
    assert line.startswith("ConfigError: partition step-000002 column 'advantages' rows 0-3: the remote reason")
    assert "\n" not in line and "\x1b" not in line and str(tmp_path / "run" / "error.log") in line
    log = (tmp_path / "run" / "error.log").read_text()
    assert "Traceback" in log and "the remote reason" in log and "\x1b" not in log


def test_a_full_disk_while_checkpointing_is_one_line_and_the_summary_says_it(tmp_path):
    """A full disk at the first save once ended a run with a traceback, no summary.json and .tmp files left.
    checkpoint_dir on a 2 MiB tmpfs (the checkpoint needs more; the real disk is never filled): exit 2, one
    `error:` line naming the folder and the fix, summary.json saying the same, nothing half-written left."""
    from test_shm_faults import need_root
    from test_train_e2e import SMALL

    from dataplane_rl.checkpoint.identity import read_run_id

    need_root("mounting a tmpfs")
    mnt = tmp_path / "tmpfs"
    mnt.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=2m", "tmpfs", str(mnt)], check=True)
    try:
        run_dir = tmp_path / "run"
        p = subprocess.run([sys.executable, "-m", "dataplane_rl.cli.main", "train", *SMALL, "checkpointing.enabled=true",
                            f"checkpointing.checkpoint_dir={mnt}", f"logger.run_dir={run_dir}"],
                           capture_output=True, text=True, timeout=600)
        lines = [x for x in p.stderr.splitlines() if x.startswith("error:")]
        assert p.returncode == 2 and len(lines) == 1, p.stderr[-3000:]
        own = mnt / read_run_id(run_dir)  # the run's folder of the checkpoint_dir other runs may share
        assert lines[0].startswith(f"error: CheckpointError: the checkpoint of step 1 could not be written to {own}: "
                                   "No space left on device ("), lines[0]
        assert "checkpointing.checkpoint_dir" in lines[0] and "Traceback" not in p.stderr, p.stderr[-3000:]
        summary = json.loads((run_dir / "summary.json").read_text())
        assert summary["status"] == "failed" and f"error: {summary['error']}" == lines[0], summary
        assert "Traceback" in (run_dir / "error.log").read_text()
        assert list(mnt.iterdir()) == [own] and not list(own.iterdir()), "a half-written checkpoint was left"
        assert not [f.name for f in run_dir.rglob("*") if ".tmp" in f.name]
    finally:
        subprocess.run(["umount", "-l", str(mnt)], check=True)
