"""Smoke tests of the CLI in a subprocess, as a user runs it."""

import json
import subprocess
import sys

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq


def run(*args, check=False):
    p = subprocess.run([sys.executable, "-m", "dataplane_rl.cli.main", *args], capture_output=True, text=True,
                       timeout=120)
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
