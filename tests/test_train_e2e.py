"""GRPO end to end: real Ray actors, real stores, the tiny model. Parity, dynamic sampling, refusals."""

from __future__ import annotations

import json
import math
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import pytest

from dataplane_rl.config import load_config
from dataplane_rl.errors import DataPlaneError
from dataplane_rl.store.parquet import read_parquet_schema
from dataplane_rl.tasks import get_task

SMALL = ["grpo.num_prompts_per_step=8", "grpo.num_generations_per_prompt=4", "grpo.max_num_steps=1",
         "policy.train_global_batch_size=16", "policy.train_micro_batch_size=4", "generation.max_new_tokens=6",
         "logger.progress=false"]


def overriding(base: list[str], *overrides: str) -> list[str]:
    """`base` with `overrides` in place of its own values for the same keys: a command line sets a key once."""
    keys = {o.split("=", 1)[0] for o in overrides}
    return [o for o in base if o.split("=", 1)[0] not in keys] + list(overrides)


TRAIN_KEYS = ("train/loss", "train/pg_loss", "train/kl_penalty", "train/positive_nll_loss", "train/clip_fraction",
              "train/grad_norm", "train/global_valid_toks", "train/reward", "train/filtered_reward",
              "train/probs_ratio_mean", "train/approx_entropy", "train/logprob_mismatch")


def run(tmp_path: Path, name: str, *overrides: str):
    from dataplane_rl.driver.loop import train

    run_dir = tmp_path / name
    summary = train(load_config(None, [*SMALL, f"logger.run_dir={run_dir}", *overrides]))
    metrics = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    data = {p.name: [json.loads(x) for x in p.read_text().splitlines()] for p in sorted((run_dir / "train_data").iterdir())}
    return summary, metrics, data


def assert_store_failure_left_a_consistent_run(returncode: int, out: str, run_dir: Path,
                                               errors=("StoreUnavailableError", "CorruptChunkError")) -> None:
    """A run stopped by a lost store (or another lost component, named by `errors`): exit 2, the error
    named, whole lines, one train_data file per logged step, a failed summary."""
    assert returncode == 2, out[-3000:]
    assert any(e in out for e in errors), out[-3000:]
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["status"] == "failed" and summary["error"]
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    assert summary["steps_completed"] == len(lines) >= 1
    for line in lines:
        json.loads(line)
    assert len(list((run_dir / "train_data").glob("step_*.jsonl"))) == len(lines)


# train/logprob_mismatch is the mean |generation - training| log-prob gap: float rounding, which changes
# with the matmul shapes (micro-batch size, ranks). Runs that differ in shape must agree that it is noise,
# not on the noise itself; runs with the same shapes still compare it bit for bit.
NOISE_KEYS = {"train/logprob_mismatch": 1e-5}


def assert_close(a: dict, b: dict, rel=1e-5, abs_=1e-7):
    for k in TRAIN_KEYS:
        if k in NOISE_KEYS and (rel or abs_):
            assert a[k] < NOISE_KEYS[k] and b[k] < NOISE_KEYS[k], f"{k}: {a[k]} vs {b[k]}"
            continue
        if k in NOISE_KEYS:  # exact otherwise: the engine's float32 log-probs can round otherwise between two runs
            # in one Ray session (CI on the Intel VM: 9.0e-8 vs 2.8e-7), while every row and trained number is equal
            assert math.isclose(a[k], b[k], abs_tol=1e-6), f"{k}: {a[k]} vs {b[k]}"
            continue
        assert math.isclose(a[k], b[k], rel_tol=rel, abs_tol=abs_), f"{k}: {a[k]} vs {b[k]}"


# the step's 8 x 4 rows in one optimizer step: an exactly on-policy step, whose prev_logprobs come from the train
# forward (config/on_policy.py); SMALL's two optimizer steps need the separate log-prob pass
ON_POLICY = ("policy.train_global_batch_size=32",)
SHAPES = {"pass": (), "from_train": ON_POLICY}


def baseline_run(tmp_path_factory, shape: tuple[str, ...]):
    """Data plane on (shm), dp 1, micro 4, with the VAPO NLL term on; prev_logprobs from the log-prob pass (two
    optimizer steps) or from the train forward (one). Returns the run and the overrides of its shape."""
    return (*run(tmp_path_factory.mktemp("e2e"), "base", "data_plane.enabled=true",
                 "loss_fn.positive_example_nll_weight=0.1", "logger.save_rollouts=true", *shape), shape)


@pytest.fixture(scope="module")
def baseline_pass(tmp_path_factory, ray_session):
    return baseline_run(tmp_path_factory, SHAPES["pass"])


@pytest.fixture(scope="module")
def baseline_from_train(tmp_path_factory, ray_session):
    return baseline_run(tmp_path_factory, SHAPES["from_train"])


@pytest.fixture(params=sorted(SHAPES))
def baseline(request):
    """The baseline run of a shape: each runs once a module (two module fixtures, so pytest's ordering of
    parametrized tests never runs one twice)."""
    return request.getfixturevalue(f"baseline_{request.param}")


def test_data_plane_path_trains_with_nll(baseline):
    summary, metrics, data, shape = baseline
    m = metrics[0]
    assert summary["status"] == "completed"
    assert m["data_plane/enabled"] is True and m["data_plane/bytes_written"] > 0 and m["data_plane/bytes_read"] > 0
    assert m["train/positive_nll_loss"] > 0, "the VAPO term must see the rewards column on the data-plane path"
    # the driver reads per-sample scalars and texts only: far less than the token columns moved
    assert 0 < m["data_plane/driver_bytes_read"] < m["data_plane/bytes_read"]
    assert m["train/optimizer_steps"] == (1 if shape else 2) and m["train/logprob_mismatch"] < 1e-4
    # an on-policy step writes its train forward's prev_logprobs after the optimizer step (timing/prev_logprobs);
    # the generation-vs-trainer metrics still compare them with generation_logprobs
    assert ("timing/prev_logprobs" in m) == bool(shape) and 1.0 <= m["train/token_mult_prob_error"] < 1.0001
    assert len(data["step_000001.jsonl"]) == 32
    # logger.save_rollouts: the trained rows with their token columns, in train_data's order
    saved = pq.read_table(Path(summary["run_dir"]) / "rollouts/step_000001.parquet")
    assert saved.column("response_text").to_pylist() == [s["response"] for s in data["step_000001.jsonl"]]
    assert saved.column("advantages").to_pylist() == pytest.approx([s["advantage"] for s in data["step_000001.jsonl"]])
    lengths = saved.column("input_lengths").to_pylist()
    for name in ("input_ids", "token_mask", "prev_logprobs", "reference_policy_logprobs"):
        assert [len(x) for x in saved.column(name).to_pylist()] == lengths, name
    assert "teacher_topk_ids" not in saved.column_names  # never written in a GRPO run
    assert read_parquet_schema(Path(summary["run_dir"]) / "rollouts/step_000001.parquet").name == "grpo"


def test_parity_data_plane_off(baseline, tmp_path):
    base_s, base_m, base_d, shape = baseline
    _, m, d = run(tmp_path, "off", "data_plane.enabled=false", "loss_fn.positive_example_nll_weight=0.1",
                  "logger.save_rollouts=true", *shape)
    assert d == base_d, "rollouts differ between data plane on and off"
    on, off = (pq.read_table(Path(r) / "rollouts/step_000001.parquet") for r in (base_s["run_dir"], tmp_path / "off"))
    assert on.equals(off) and on.num_rows == 32  # logger.save_rollouts: the same rows and columns, both ways
    assert_close(base_m[0], m[0], rel=0, abs_=0)  # same numbers, bit for bit
    assert m[0]["data_plane/enabled"] is False


@pytest.mark.parametrize("baseline", ["pass"], indirect=True)
@pytest.mark.parametrize("override", ["policy.train_micro_batch_size=1", "policy.dp_size=2",
                                      "policy.activation_checkpointing=true"])
def test_parity_micro_batch_and_ranks(baseline, tmp_path, override):
    _, base_m, base_d, shape = baseline
    _, m, d = run(tmp_path, "p", "data_plane.enabled=true", "loss_fn.positive_example_nll_weight=0.1", override, *shape)
    assert d == base_d
    assert_close(base_m[0], m[0])


@pytest.mark.parametrize("baseline", ["from_train"], indirect=True)
def test_an_on_policy_step_over_two_ranks(baseline, tmp_path):
    """Each rank writes its rows' prev_logprobs from its own train forward (4 microbatches a rank): the numbers of
    one rank. (Micro-batch size and checkpointing add nothing to an on-policy step that the pass's parity runs
    do not check, and their runs would cost CI minutes.)"""
    _, base_m, base_d, shape = baseline
    _, m, d = run(tmp_path, "p", "data_plane.enabled=true", "loss_fn.positive_example_nll_weight=0.1",
                  "policy.dp_size=2", *shape)
    assert d == base_d and m[0]["train/optimizer_steps"] == 1 and "timing/prev_logprobs" in m[0]
    assert_close(base_m[0], m[0])


@pytest.mark.parametrize("baseline", ["from_train"], indirect=True)
def test_an_on_policy_step_gives_the_numbers_of_the_forced_pass(baseline, tmp_path):
    """policy.force_prev_logprobs_pass=true scores prev_logprobs in the separate pass, as every step did before
    on-policy steps took them from the train forward: the same rows, metrics (1e-5; here bit for bit, the pass and
    the train forward run the same microbatches) and stored prev_logprobs column."""
    base_s, base_m, base_d, shape = baseline
    s, m, d = run(tmp_path, "forced", "data_plane.enabled=true", "loss_fn.positive_example_nll_weight=0.1",
                  "logger.save_rollouts=true", *shape, "policy.force_prev_logprobs_pass=true")
    assert d == base_d and "timing/prev_logprobs" not in m[0]
    assert_close(base_m[0], m[0])
    on, forced = (pq.read_table(Path(r["run_dir"]) / "rollouts/step_000001.parquet") for r in (base_s, s))
    assert np.allclose(np.concatenate(on.column("prev_logprobs").to_pylist()),
                       np.concatenate(forced.column("prev_logprobs").to_pylist()), rtol=0, atol=1e-6)


def test_dynamic_sampling_keeps_whole_informative_groups(tmp_path, ray_session):
    G = 4
    _, metrics, data = run(tmp_path, "dyn", "grpo.use_dynamic_sampling=true", "grpo.max_gen_batches=10",
                           "grpo.max_num_steps=2", "data_plane.enabled=true")
    assert max(m["train/generation_rounds"] for m in metrics) >= 2, "this seed should need extra rounds"
    task = get_task("repeat")
    for m, rows in zip(metrics, data.values()):
        assert len(rows) == 32
        groups: dict[tuple, list] = {}
        for r in rows:
            assert r["total_reward"] == pytest.approx(task.reward(r["prompt"], r["response"]), abs=1e-6)
            partition = r["sample_id"].split("/")[0]
            groups.setdefault((partition, r["group_id"]), []).append(r)
        for members in groups.values():
            assert len(members) == G, "groups must be kept whole"
            assert len({m["total_reward"] for m in members}) > 1, "kept groups have non-equal rewards"
            assert len({m["prompt"] for m in members}) == 1
        # filtered_reward is the mean over exactly the trained rows, and those come from the step's rounds
        # in order: the last round generated is the one that completed the batch
        assert m["train/filtered_reward"] == pytest.approx(sum(r["total_reward"] for r in rows) / len(rows), abs=1e-6)
        step, rounds = m["step"], m["train/generation_rounds"]
        names = [f"step-{step:06d}"] + [f"step-{step:06d}-r{i}" for i in range(1, rounds)]
        used = {r["sample_id"].split("/")[0] for r in rows}
        assert used <= set(names) and names[-1] in used, (used, names)


def test_dynamic_sampling_gives_up_clearly(tmp_path, ray_session):
    from dataplane_rl.driver.loop import DynamicSamplingError

    with pytest.raises(DynamicSamplingError, match="max_gen_batches=1"):
        run(tmp_path, "dyn_fail", "grpo.use_dynamic_sampling=true", "grpo.max_gen_batches=1",
            "grpo.num_prompts_per_step=16")
    summary = json.loads((tmp_path / "dyn_fail" / "summary.json").read_text())
    assert summary["status"] == "failed" and "max_gen_batches" in summary["error"]


def tensorboard_scalars(run_dir: Path) -> dict[str, dict[int, float]]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(run_dir / "tensorboard"), size_guidance={"scalars": 0})
    events.Reload()
    return {tag: {e.step: e.value for e in events.Scalars(tag)} for tag in events.Tags()["scalars"]}


def test_validation_never_trains_and_tensorboard_has_every_metric(tmp_path, ray_session):
    """Validation at start and after every step, 3 partitions each, changes no training number; every
    metric of metrics.jsonl is in the TensorBoard event files at its step."""
    val = ["grpo.max_num_steps=2", "data_plane.enabled=true", "grpo.val_at_start=true", "grpo.val_period=1",
           "grpo.max_val_samples=40", "grpo.val_batch_size=16"]
    summary, metrics, data = run(tmp_path, "val", *val)
    _, plain, plain_data = run(tmp_path, "plain", *val[:2], "grpo.val_period=0", "logger.tensorboard_enabled=false")
    assert [m["step"] for m in metrics] == [0, 1, 2] and summary["steps_completed"] == 2
    for m in metrics:
        assert m["validation/num_samples"] == 40
        assert 0 <= m["validation/accuracy"] <= m["validation/reward"] <= 1 and m["timing/validation"] > 0
    assert [m["step"] for m in plain] == [1, 2] and not any("validation/reward" in m for m in plain)
    assert data == plain_data, "validation changed the training rollouts"
    for a, b in zip(metrics[1:], plain):
        assert_close(a, b, rel=0, abs_=0)
    assert not (tmp_path / "plain" / "tensorboard").exists()
    tb = tensorboard_scalars(tmp_path / "val")
    for m in metrics:
        for k, v in m.items():
            if k != "step":
                assert tb[k][m["step"]] == pytest.approx(float(v), rel=1e-6, abs=1e-6), k


def cli(*args, **kw):
    return subprocess.run([sys.executable, "-m", "dataplane_rl.cli.main", *args], capture_output=True, text=True,
                          timeout=600, **kw)


def test_refuses_nll_without_rewards_before_starting(tmp_path):
    fields = "[input_ids,input_lengths,token_mask,sample_mask,prev_logprobs,reference_policy_logprobs,advantages]"
    t0 = time.monotonic()
    p = cli("train", "loss_fn.positive_example_nll_weight=0.1", f"data_plane.train_fields={fields}",
            f"logger.run_dir={tmp_path / 'never'}")
    assert p.returncode == 2 and "rewards" in p.stderr and "total_reward" in p.stderr
    assert not (tmp_path / "never").exists(), "nothing may start before the config is valid"
    assert time.monotonic() - t0 < 60


# task.module for the CLI run: the examples' Parquet rows, with the pid of the process that made each row's
# data_source; every import of the module (driver, each actor) appends its pid to a side file
PID_MODULE = """
import os
from dataplane_rl.tasks import register_task
from dataplane_rl.tasks.dataset import DatasetTask, PromptRow

with open(os.path.join(os.path.dirname(os.path.abspath(__file__)), "imports.txt"), "a") as f:
    f.write(f"{os.getpid()}\\n")


class PidDataset(DatasetTask):
    def row(self, prompt):
        r = super().row(prompt)
        return PromptRow(f"{r.data_source}@{os.getpid()}", r.ground_truth, r.extra_info)


register_task("pid_dataset", lambda path=None, tokenizer=None: PidDataset(path, tokenizer=tokenizer))
"""


def test_train_cli_writes_the_run_folder(tmp_path):
    """The CLI run, on your own data, reward and task (docs/tasks.md): the examples' verl-layout Parquet file and
    reward file, through a task.module task, with 2 rollout actors."""
    import pyarrow.parquet as pq

    examples = Path(__file__).resolve().parents[1] / "examples"
    (tmp_path / "pid_task.py").write_text(PID_MODULE)
    # the examples' reward, printing each score: a print in the rollout actors goes to the run folder, not stdout
    (tmp_path / "reward.py").write_text((examples / "reward.py").read_text() + (
        "\n\n_score = compute_score\n\n\ndef compute_score(data_source, solution_str, ground_truth, extra_info=None):\n"
        "    print('scoring', repr(solution_str))\n    return _score(data_source, solution_str, ground_truth, extra_info)\n"))
    byo = [f"task.module={tmp_path / 'pid_task.py'}", "task.name=pid_dataset",
           f"task.path={examples / 'data' / 'train.parquet'}", f"task.reward_function={tmp_path / 'reward.py'}",
           "generation.num_workers=2"]
    run_dir = tmp_path / "cli"
    p = cli("train", *overriding(SMALL, "grpo.max_num_steps=2"), f"logger.run_dir={run_dir}", "data_plane.enabled=true", *byo)
    assert p.returncode == 0, p.stderr[-3000:]
    # stdout is the summary alone (`| jq` works); logger.progress=false still prints the last step's line
    out = json.loads(p.stdout)
    assert out["status"] == "completed" and out["run_dir"] == str(run_dir)
    printed = (run_dir / "rollout_stdout.log").read_text().splitlines()
    assert len(printed) >= 2 * 32 and all(line.startswith("scoring ") for line in printed)
    assert out["plot"] == str(run_dir / "reward.png")
    assert "grpo step 2/2: reward " in p.stderr, p.stderr[-3000:]
    for f in ("config.yaml", "metrics.jsonl", "reward.png", "summary.json", "train_data/step_000001.jsonl",
              "train_data/step_000002.jsonl"):
        assert (run_dir / f).is_file(), f
    assert list((run_dir / "tensorboard").glob("events.out.tfevents.*")), "no TensorBoard event file"
    # summary.json's memory: every process of the run once (its own Ray's too), PSS, and their sum
    memory = json.loads((run_dir / "summary.json").read_text())["memory"]
    roles = [r["role"] for r in memory["processes"]]
    want = {"supervisor", "driver", "train-rank-0", "rollout-0", "rollout-1", "raylet", "gcs_server"}
    assert want <= set(roles), roles
    assert memory["measure"] == "pss" and all(0 < r["peak_mb"] <= r["peak_rss_mb"] for r in memory["processes"])
    assert memory["sum_peak_mb"] == pytest.approx(sum(r["peak_mb"] for r in memory["processes"]), abs=0.1 * len(roles))
    assert 0 < memory["peak_total_mb"] <= memory["sum_peak_mb"] + 0.1 * len(roles)
    lines = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in lines] == [1, 2]
    for key in (*TRAIN_KEYS, "data_plane/bytes_written", "data_plane/driver_bytes_read", "timing/step"):
        assert key in lines[0], key
    sample = json.loads((run_dir / "train_data/step_000001.jsonl").read_text().splitlines()[0])
    assert set(sample) == {"sample_id", "group_id", "prompt", "response", "total_reward", "advantage", "sample_mask",
                           "generation_policy_version", "num_turns", "end_reason", "data_source", "extra_info",
                           "dataset_row", "ground_truth", "reward_extra_info"}
    assert sample["num_turns"] == 1 and sample["end_reason"] in ("done", "length")
    # every stored total_reward is the user's function of the row; the module's task made every row
    sys.path.insert(0, str(examples))
    try:
        from reward import compute_score
    finally:
        sys.path.pop(0)
    file_rows = pq.read_table(examples / "data" / "train.parquet").to_pylist()
    rows = [json.loads(x) for f in sorted((run_dir / "train_data").iterdir()) for x in f.read_text().splitlines()]
    assert len(rows) == 2 * 32
    for r in rows:  # each sample names its row, and its prompt, ground truth and extra_info are that row's
        src, pid = file_rows[r["dataset_row"]], r["data_source"].split("@")[1]
        assert r["prompt"] == f"<bos>user: {src['prompt'][0]['content']}\nassistant: "  # the template writes BOS
        assert r["ground_truth"] == src["reward_model"]["ground_truth"]
        assert r["data_source"] == f"{src['data_source']}@{pid}" and json.loads(r["extra_info"]) == src["extra_info"]
        want = compute_score(src["data_source"], r["response"], src["reward_model"]["ground_truth"], src["extra_info"])
        assert r["total_reward"] == float(np.float32(want["score"]))
        assert json.loads(r["reward_extra_info"]) == {k: v for k, v in want.items() if k != "score"}  # the dict's rest
    pids = {r["data_source"].split("@")[1] for r in rows}
    imports = set((tmp_path / "imports.txt").read_text().split())
    assert len(pids) == 2 and pids <= imports, "each of the 2 rollout actors must make rows with the module's task"
    assert len(imports) >= 4, "imported in the driver, both rollout actors and the train worker"
    for m in lines:  # train/reward/<data_source>: the mean of that source's rows (no dynamic sampling: all kept)
        mine = [r for r in rows if r["sample_id"].startswith(f"step-{m['step']:06d}/")]
        for s in {r["data_source"] for r in mine}:
            want = np.mean([np.float32(r["total_reward"]) for r in mine if r["data_source"] == s])
            assert m[f"train/reward/{s}"] == pytest.approx(want, rel=1e-6)
        # train/reward_extra/<key>: the mean of the reward dicts' other keys over the step's trained samples
        assert m["train/reward_extra/correct"] == pytest.approx(np.mean([json.loads(r["reward_extra_info"])["correct"]
                                                                        for r in mine]))
    assert load_config(run_dir / "config.yaml").grpo.max_num_steps == 2  # the resolved config reloads
    store_url = json.loads((run_dir / "summary.json").read_text())["store_url"]
    assert store_url.startswith("shm:///") and not Path(store_url[len("shm://"):]).exists(), \
        "the run's own shm folder must be freed at the end"
    # the resolved store, named from the start (store.json, and printed) for `store ls RUN_DIR` on a live run
    assert json.loads((run_dir / "store.json").read_text()) == {"store_url": store_url}
    assert f"store {store_url} (dataplane-rl store ls {run_dir})" in p.stderr
    assert out["final_validation_reward"] == lines[-1]["validation/reward"]  # validated after the last step
    # validation/reward/<data_source>: the held-out file's two sources (the module's task tags them with the actor's pid)
    per_source = {k.split("/")[2].split("@")[0] for k in lines[-1] if k.startswith("validation/reward/")}
    assert per_source == {"add", "sub"}, sorted(lines[-1])


def _sigint_default():
    signal.signal(signal.SIGINT, signal.SIG_DFL)  # a child of `&`/nohup inherits SIGINT ignored


def test_ctrl_c_ends_the_step_and_leaves_a_consistent_run_folder(tmp_path):
    """SIGINT (Ctrl-C) with the default disposition ends the current step and leaves status 'interrupted'
    (tests/test_preempt.py stops runs with SIGTERM and SIGHUP, with checkpointing on)."""
    import psutil

    run_dir = tmp_path / "int"
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    proc = subprocess.Popen([sys.executable, "-m", "dataplane_rl.cli.main", "train", *overriding(SMALL, "grpo.max_num_steps=200"),
                             f"logger.run_dir={run_dir}", "data_plane.enabled=true"],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env,
                            preexec_fn=_sigint_default)
    metrics = run_dir / "metrics.jsonl"
    deadline = time.monotonic() + 300
    while not (metrics.is_file() and metrics.read_text().count("\n") >= 2):
        assert proc.poll() is None, f"the run exited ({proc.returncode}) before step 2: {proc.stdout.read()[-3000:]}"
        assert time.monotonic() < deadline, "no step 2 within 300 s"
        time.sleep(0.5)
    kids = [c.pid for c in psutil.Process(proc.pid).children(recursive=True)]
    proc.send_signal(signal.SIGINT)
    out, _ = proc.communicate(timeout=120)
    assert proc.returncode == 128 + signal.SIGINT, out[-3000:]
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["status"] == "interrupted" and summary["error"] == "SIGINT"
    lines = metrics.read_text().splitlines()
    assert summary["steps_completed"] == len(lines) >= 2
    for line in lines:
        json.loads(line)  # every line whole
    assert len(list((run_dir / "train_data").glob("step_*.jsonl"))) == len(lines)
    assert not list(run_dir.rglob("*.tmp*"))
    store_url = summary["store_url"]
    assert not Path(store_url[len("shm://"):]).exists(), "the run's shm folder must be freed"
    _, alive = psutil.wait_procs([psutil.Process(k) for k in kids if psutil.pid_exists(k)], timeout=30)
    assert not alive, f"processes left running: {alive}"


LEARNING_PAGES = {"sync": "README.md", "async": "docs/grpo.md"}  # the pages whose commands they run


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["sync", "async"])
def test_default_config_learns(tmp_path, mode):
    """The README's promise, the whole default run (seed 0, 100 steps; 58 s idle): the task is mastered, in
    the sampled train reward and in greedy decoding of held-out prompts, and the sync run gives exactly the
    figures the README's quick start prints. Async GRPO (age 1, importance-sampling correction) learns it
    too, training on rows one update old. Each runs its page's command as written (the README's quick start,
    docs/grpo.md's async command: tests/test_readme.py hands those blocks to this file), in a run folder of
    its own."""
    from test_readme import page_command

    run_dir = tmp_path / "learn"
    argv = page_command(LEARNING_PAGES[mode], "tests/test_train_e2e.py")
    assert (mode == "async") == ("grpo.async_grpo.enabled=true" in argv), argv
    p = cli(*overriding(argv, f"logger.run_dir={run_dir}", "logger.progress=false"))
    assert p.returncode == 0, p.stderr[-3000:]
    metrics = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["steps_completed"] == len(metrics) == 100
    from test_trace import assert_run_trace

    # the default run's timeline: every step of every process, far below its bound
    doc = assert_run_trace(run_dir, ["driver", "rollout-0", "train-rank-0"], list(range(1, 101)),
                           data_plane=mode == "async", sync=mode == "sync")
    assert "validation" in {e["name"] for e in doc["traceEvents"]}
    assert summary["reward_first_quarter"] < 0.5, "the untrained policy must not already solve the task"
    assert summary["reward_last_quarter"] >= 0.8, summary
    val = [m for m in metrics if "validation/reward" in m]
    assert [m["step"] for m in val] == list(range(10, 101, 10))
    assert val[-1]["validation/reward"] >= 0.9 and val[-1]["validation/num_samples"] == 128, val[-1]
    if mode == "async":
        assert all(m["async/staleness_max"] == (m["step"] > 1) for m in metrics if "async/staleness_max" in m)
    elif cpu_vendor() in ("GenuineIntel", "AuthenticAMD"):  # deterministic per CPU: the README states its figures
        promised = readme_default_run_figures(cpu_vendor())
        assert promised == (round(summary["reward_last_quarter"], 3), round(val[-1]["validation/reward"], 3)), \
            f"README quick start promises last-quarter/final validation {promised}; the run gave " \
            f"{summary['reward_last_quarter']:.3f}/{val[-1]['validation/reward']:.3f}: update the README and " \
            "docs/reward_default.png (copy the run's reward.png)"


def readme_default_run_figures(vendor: str = "GenuineIntel") -> tuple[float, float]:
    """(last-quarter train reward, final validation reward) as the README's quick start states them for a CPU of
    `vendor` (float32 kernels differ between CPUs: the README states the Intel and the AMD machine's figures)."""
    import re

    text = " ".join((Path(__file__).parents[1] / "README.md").read_text().split())
    pattern = (r"last-quarter mean of \*\*([0-9.]+)\*\*.*? ends at \*\*([0-9.]+)\*\*, on a 2-core Intel" if vendor == "GenuineIntel"
               else r"on a 2-core AMD EPYC VM the same run gives \*\*([0-9.]+)\*\* and \*\*([0-9.]+)\*\*")
    m = re.search(pattern, text)
    assert m, f"the README's quick start no longer states the default run's figures on a {vendor} CPU"
    return float(m[1]), float(m[2])


def cpu_vendor() -> str:
    """/proc/cpuinfo's vendor_id (GenuineIntel, AuthenticAMD), or '' where it names none."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("vendor_id"):
                return line.partition(":")[2].strip()
    except OSError:
        pass
    return ""


def test_readme_states_the_default_run_figures():
    """The parser the learning test uses finds the README's two figures of each CPU (cheap; the run itself is slow)."""
    for vendor in ("GenuineIntel", "AuthenticAMD"):
        last_quarter, validation = readme_default_run_figures(vendor)
        assert 0.8 <= last_quarter <= 1 and 0.9 <= validation <= 1


def test_mooncake_holder_killed_mid_run_fails_clearly(tmp_path):
    """Data dies with its holder: the run must stop with a clear store error, and the run folder must
    stay consistent (whole lines, one train_data file per logged step, a failed summary)."""
    from conftest import backend_unavailable

    try:
        from dataplane_rl.store.mooncake.cluster import MooncakeCluster

        cluster = MooncakeCluster(num_holders=1, global_segment_size=64 << 20).start()
    except (ImportError, DataPlaneError) as e:
        backend_unavailable("mooncake", str(e))
    run_dir = tmp_path / "mc"
    try:
        proc = subprocess.Popen([sys.executable, "-m", "dataplane_rl.cli.main", "train", *overriding(SMALL, "grpo.max_num_steps=500"),
                                 f"logger.run_dir={run_dir}", "data_plane.enabled=true",
                                 f"data_plane.backend={cluster.url}"],
                                stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        metrics = run_dir / "metrics.jsonl"
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline and proc.poll() is None and not (metrics.is_file() and metrics.read_text()):
            time.sleep(0.5)
        assert proc.poll() is None, "the run ended before the holder was killed"
        cluster.kill_holder(0, signal.SIGKILL)
        out, _ = proc.communicate(timeout=400)
    finally:
        cluster.close()
    assert_store_failure_left_a_consistent_run(proc.returncode, out, run_dir)
