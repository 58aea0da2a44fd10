"""Smoke tests of the CLI in a subprocess, as a user runs it."""

import json
import subprocess
import sys

import numpy as np
import pytest
import pyarrow as pa
import pyarrow.parquet as pq


def run(*args, check=False, timeout=120):
    p = subprocess.run([sys.executable, "-m", "dataplane_rl.cli.main", *args], capture_output=True, text=True,
                       timeout=timeout)
    if check:
        assert p.returncode == 0, p.stderr
    return p


def test_help_lists_commands():
    out = run("--help", check=True).stdout
    for cmd in ("schema", "config"):
        assert cmd in out


def test_schema_show_json_has_train_fields_and_alias():
    doc = json.loads(run("schema", "show", "--json", check=True).stdout)
    assert "total_reward" in doc["field_sets"]["DP_TRAIN_FIELDS"]
    reward = next(c for c in doc["columns"] if c["name"] == "total_reward")
    assert reward["alias"] == "rewards" and "DP_TRAIN_FIELDS" in reward["field_sets"]


def test_schema_show_table_and_field_set():
    out = run("schema", "show", "--field-set", "DRIVER_FIELDS", check=True).stdout
    assert "total_reward" in out and "rewards" in out and "input_ids" not in out
    bad = run("schema", "show", "--field-set", "NOPE")
    assert bad.returncode != 0 and "no field set 'NOPE'" in bad.stderr


def test_config_show_unknown_key_fails_naming_it():
    p = run("config", "show", "loss_fn.nope=1")
    assert p.returncode != 0 and "loss_fn.nope" in p.stderr


def test_config_show_resolves_overrides():
    out = run("config", "show", "data_plane.enabled=true", check=True).stdout
    assert "enabled: true" in out


def _rollout_table(n=3, bad=False):
    lengths = np.array([4, 2, 3][:n], dtype=np.int32)
    ids_len = lengths.copy()
    if bad:
        ids_len[1] += 1
    cols = {
        "input_ids": pa.array([list(range(k)) for k in ids_len], type=pa.list_(pa.int32())),
        "input_lengths": pa.array(lengths),
        "token_mask": pa.array([[0] + [1] * (k - 1) for k in lengths], type=pa.list_(pa.int8())),
        "generation_logprobs": pa.array([[0.0] * k for k in lengths], type=pa.list_(pa.float32())),
        "total_reward": pa.array([1.0, 0.0, 0.5], type=pa.float64() if bad else pa.float32()),
        "group_id": pa.array([0, 0, 1], type=pa.int64()),
        "truncated": pa.array([False, True, False]),
        "prompt_text": pa.array(["a", "b", "c"]),
        "response_text": pa.array(["x", "y", "z"]),
        "generation_policy_version": pa.array([0, 0, 0], type=pa.int64()),
        "turn_index": pa.array([[0] + [1] * (k - 1) for k in lengths], type=pa.list_(pa.int16())),
        "token_policy_version": pa.array([[-1] + [0] * (k - 1) for k in lengths], type=pa.list_(pa.int32())),
        "num_turns": pa.array([1, 1, 1], type=pa.int32()),
        "observation_tokens": pa.array([0, 0, 0], type=pa.int32()),
        "end_reason": pa.array(["done", "length", "done"]),
        "data_source": pa.array(["repeat"] * 3),
        "extra_info": pa.array(["{}"] * 3),
        "dataset_row": pa.array([-1] * 3, pa.int64()),
        "ground_truth": pa.array(["null"] * 3),
        "reward_extra_info": pa.array(["{}"] * 3),
    }
    if bad:
        del cols["group_id"]
        cols["extra"] = pa.array([1, 2, 3])
    return pa.table(cols)


def test_schema_validate_good_parquet_and_arrow(tmp_path):
    t = _rollout_table()
    pq.write_table(t, tmp_path / "ok.parquet")
    with pa.ipc.new_file(tmp_path / "ok.arrow", t.schema) as w:
        w.write_table(t)
    for name in ("ok.parquet", "ok.arrow"):
        out = run("schema", "validate", str(tmp_path / name), check=True).stdout
        assert "3 rows" in out


def test_schema_validate_reports_every_violation(tmp_path):
    pq.write_table(_rollout_table(bad=True), tmp_path / "bad.parquet")
    p = run("schema", "validate", str(tmp_path / "bad.parquet"))
    assert p.returncode == 1
    err = p.stderr
    assert "column 'total_reward'" in err and "float64" in err          # wrong dtype
    assert "column 'input_ids' rows 1" in err                          # token length mismatch, with its row
    assert "column 'group_id'" in err and "missing" in err             # missing declared column
    assert "column 'extra'" in err and "not declared" in err           # extra column


def test_schema_validate_missing_file(tmp_path):
    p = run("schema", "validate", str(tmp_path / "nope.parquet"))
    assert p.returncode != 0 and "not found" in p.stderr


def test_schema_show_names_the_file_relative_to_the_checkout(tmp_path):
    p = subprocess.run([sys.executable, "-m", "dataplane_rl.cli.main", "schema", "show"], capture_output=True,
                       text=True, timeout=120, cwd=tmp_path)  # from any folder: the path the README names
    assert p.returncode == 0, p.stderr
    assert p.stdout.splitlines()[0] == "schema grpo v1 (schema/grpo.yaml)"


def test_closed_pipe_exits_quietly():
    """`dataplane-rl schema show --json | head`: the reader is gone before the command writes."""
    proc = subprocess.Popen([sys.executable, "-m", "dataplane_rl.cli.main", "schema", "show", "--json"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    proc.stdout.close()  # this process held the only read end: every write of the child now fails (EPIPE)
    _, err = proc.communicate(timeout=120)
    assert "Traceback" not in err and "BrokenPipeError" not in err, err
    assert proc.returncode == 141  # 128 + SIGPIPE, what `cat` reports in the same place


CTRL_C_IN = """
import sys
class CtrlC:  # a Ctrl-C that lands while this module is being imported
    def find_spec(self, name, path=None, target=None):
        if name == {module!r}:
            raise KeyboardInterrupt
sys.meta_path.insert(0, CtrlC())
from dataplane_rl.cli.main import main
sys.exit(main({argv!r}))
"""


@pytest.mark.parametrize("module,argv", [
    ("dataplane_rl.bench.store", ["--help"]),       # the benchmarks' modules (numpy, pyarrow) load with the parser
    ("dataplane_rl.errors", ["schema", "show"]),   # what the command line itself imports first
    ("dataplane_rl.config.load", ["config", "show", "grpo.seed=1"]),
])
def test_ctrl_c_while_the_command_loads_is_one_line(module, argv):
    """A Ctrl-C in the first second of `dataplane-rl ...` printed a traceback: the command modules (and their numpy
    and pyarrow) were imported before the KeyboardInterrupt guard. Every import now happens inside it."""
    p = subprocess.run([sys.executable, "-c", CTRL_C_IN.format(module=module, argv=argv)], capture_output=True,
                       text=True, timeout=120)
    assert (p.returncode, p.stderr) == (130, "interrupted\n"), p.stderr[-3000:]


def test_whatever_crossed_ray_is_one_error_line(monkeypatch, capsys):
    """An environment's bad step reached the user as `error: RayTaskError(EpisodeError): ESC[36mray::...` and a
    remote traceback; a cancelled task (a reward raising KeyboardInterrupt) as ~60 lines. Each of Ray's errors,
    as Ray builds them, is one `error:` line: the error raised inside the actor, no wrapper text, no colour
    codes, and the run's error.log named when the run wrote one."""
    import ray.exceptions as rx

    from dataplane_rl.cli import main as cli, trace_cmd
    from dataplane_rl.errors import ConfigError
    from dataplane_rl.rollout.multiturn import EpisodeError

    def remote(cause):
        return rx.RayTaskError("RolloutWorker.generate", "Traceback (most recent call last):\n  File \"w.py\", "
                               "line 3, in step\n" + f"{type(cause).__name__}: {cause}", cause,
                               proctitle="ray::RolloutWorker.generate()", pid=12, ip="127.0.0.1").as_instanceof_cause()

    bad_step = EpisodeError("task 'guess' env.step turn 2: returned 'x', not a StepResult; fix the environment")
    nested = rx.RayTaskError("outer", "tb", remote(ConfigError("the inner reason\nmore")), proctitle="ray::outer()")
    cases = [  # (raised, its line, exit code)
        (remote(bad_step), f"error: EpisodeError: {bad_step}", 2),
        (nested, "error: ConfigError: the inner reason", 2),  # a task whose task failed: the innermost error
        (rx.TaskCancelledError(), "error: TaskCancelledError: Raised when this task is cancelled.", 1),
        (remote(ValueError("raw user error")), "error: ValueError: raw user error", 1),
    ]
    logged = remote(bad_step)
    logged.run_error = f"EpisodeError: {bad_step} (traceback: /runs/r/error.log)"  # RunDir.record_error's line
    cases.append((logged, f"error: EpisodeError: {bad_step} (traceback: /runs/r/error.log)", 2))
    capsys.readouterr()
    for raised, line, code in cases:

        def fail(args, raised=raised):
            raise raised

        monkeypatch.setattr(trace_cmd, "run", fail)
        assert cli.main(["trace", "x"]) == code
        err = capsys.readouterr().err
        assert err == line + "\n", (raised, err)
    assert "\x1b[36mray::RolloutWorker.generate()" in str(remote(bad_step))  # what the line no longer carries

    def bug(args):
        raise RuntimeError("a bug of ours outside any run")

    monkeypatch.setattr(trace_cmd, "run", bug)
    with pytest.raises(RuntimeError):  # its traceback is the useful output
        cli.main(["trace", "x"])


BAD_ENV = '''
import sys
sys.path.insert(0, {examples!r})
from env import Countdown
from dataplane_rl.tasks import register_task
from dataplane_rl.tasks.multiturn import EnvStep


class BadStep(Countdown):
    name = "bad_step"

    def step(self, prompt, actions):
        return EnvStep(42, False, 0.0)  # an observation that is not text


register_task("bad_step", lambda path=None: BadStep())
'''


def test_an_environments_bad_step_is_one_line_from_a_real_run(tmp_path):
    """The probe as a user met it: an environment's bad step inside a rollout actor reached the terminal as
    `error: RayTaskError(EpisodeError): ESC[36mray::...` and ~15 remote lines. Now one line, the summary's,
    naming error.log, which holds the remote traceback."""
    from pathlib import Path

    from test_train_e2e import SMALL, overriding

    module = tmp_path / "bad_env.py"
    module.write_text(BAD_ENV.format(examples=str(Path(__file__).parent.parent / "examples")))
    run_dir = tmp_path / "run"
    p = run("train", *overriding(SMALL, "task.name=bad_step", f"task.module={module}",
                                 "policy.max_total_sequence_length=48", "generation.max_new_tokens=2",
                                 "multi_turn.max_turns=3", f"logger.run_dir={run_dir}"), timeout=600)
    assert p.returncode == 2, p.stderr[-3000:]
    lines = [x for x in p.stderr.splitlines() if x.startswith("error:")]
    assert len(lines) == 1 and lines[0].startswith("error: EpisodeError: task 'bad_step' turn 1 row "), p.stderr[-3000:]
    assert "observation 42 (int)" in lines[0] and lines[0].endswith(f"(traceback: {run_dir / 'error.log'})")
    assert "\x1b" not in p.stderr and "RayTaskError" not in p.stderr and "Traceback" not in p.stderr, p.stderr[-3000:]
    assert json.loads((run_dir / "summary.json").read_text())["error"] == lines[0].removeprefix("error: ")
    assert "RayTaskError(EpisodeError)" in (run_dir / "error.log").read_text()  # the whole story is kept there
