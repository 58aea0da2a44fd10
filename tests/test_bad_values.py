"""Values a schema refuses on every backend: nulls inside token lists, NaN and inf in float columns
(unless the column declares allow_nonfinite), in stores and in `schema validate`; and a training step
whose loss goes non-finite stops the run."""

from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from dataplane_rl.errors import SchemaError
from dataplane_rl.schema import GRPO_SCHEMA, Column, Schema
from store_workers import grpo_columns

FLOAT_COLUMNS = [c.name for c in GRPO_SCHEMA.columns if c.dtype.startswith("float")]


def lengths(*n):
    return {"input_lengths": np.array(n, np.int32)}


@pytest.mark.parametrize("column,values", [
    ("prev_logprobs", pa.array([[0.5, None], [1.0]], type=pa.list_(pa.float32()))),
    ("input_ids", pa.array([[1, 2], [None]], type=pa.list_(pa.int32()))),
], ids=["float-tokens", "int-tokens"])
def test_nulls_inside_token_lists_are_refused(store, column, values):
    store.create_partition("p", "grpo", 2)
    store.put("p", lengths(2, 1), range(2))
    row = 0 if column == "prev_logprobs" else 1
    with pytest.raises(SchemaError, match=rf"column '{column}' rows {row}: has null values inside token lists"):
        store.put("p", {column: values}, range(2))
    assert store.status("p").rows_written[column] == 0


@pytest.mark.parametrize("column", FLOAT_COLUMNS)
@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf], ids=["nan", "inf", "-inf"])
def test_non_finite_floats_are_refused_in_every_float_column(store, column, bad):
    store.create_partition("p", "grpo", 4)
    cols = grpo_columns(range(4), [column, "input_lengths"])
    if GRPO_SCHEMA.by_name[column].kind == "token":
        cols[column][2] = cols[column][2].copy()
        cols[column][2][-1] = bad
    else:
        cols[column][2] = bad
    with pytest.raises(SchemaError, match=rf"column '{column}' rows 2: has NaN or infinite values"):
        store.put("p", cols, range(4))
    assert sum(store.status("p").rows_written.values()) == 0


@pytest.mark.filterwarnings("ignore:overflow encountered in dot:RuntimeWarning")  # the huge values: the point
def test_a_nan_found_while_writing_leaves_nothing_and_huge_finite_values_pass(store):
    """NaN/inf are found as the write copies each piece (a put of 3 pieces of 256 KiB here, the NaN in the
    last one): the put fails whole, its cells stay free; values whose squares overflow the check's sum
    (1e30 in float32) are finite, and the exact check lets them through."""
    n = 200_000  # 800 kB of float32 values: the last piece holds the NaN
    store.create_partition("p", "grpo", 2)
    store.put("p", lengths(n, 1), range(2))
    bad = np.ones(n, np.float32)
    bad[-1] = np.nan
    with pytest.raises(SchemaError, match="column 'prev_logprobs' rows 0: has NaN or infinite values"):
        store.put("p", {"prev_logprobs": [bad, np.ones(1, np.float32)]}, range(2))
    assert store.status("p").rows_written["prev_logprobs"] == 0
    store.chunk_bytes = 64  # a block per row: the NaN in the second block is found there too
    try:
        with pytest.raises(SchemaError, match="column 'prev_logprobs' rows 1: has NaN or infinite values"):
            store.put("p", {"prev_logprobs": [np.ones(n, np.float32), np.full(1, np.inf, np.float32)]}, range(2))
    finally:
        del store.chunk_bytes
    assert store.status("p").rows_written["prev_logprobs"] == 0
    huge = np.full(n, 1e30, np.float32)  # finite, but v.v overflows to inf
    store.put("p", {"prev_logprobs": [huge, np.ones(1, np.float32)]}, range(2))
    assert np.array_equal(store.get("p", "prev_logprobs", [0]).column(0).chunk(0).flatten().to_numpy(), huge)


def test_a_column_may_declare_non_finite_values_valid(store):
    schema = Schema(name="nf", columns=(Column(name="score", dtype="float32", kind="sample", writer="rollout",
                                               allow_nonfinite=True),
                                        Column(name="other", dtype="float32", kind="sample", writer="rollout")))
    store.create_partition("p", schema, 3)
    store.put("p", {"score": np.array([np.nan, np.inf, 1], np.float32)}, range(3))
    assert store.get("p", ["score"]).column(0).to_pylist()[1:] == [float("inf"), 1.0]
    with pytest.raises(SchemaError, match="column 'other' rows 0"):
        store.put("p", {"other": np.array([np.nan, 0, 0], np.float32)}, range(3))
    with pytest.raises(ValueError, match="allow_nonfinite applies to float columns"):
        Column(name="x", dtype="int32", kind="sample", writer="rollout", allow_nonfinite=True)


def test_pad_tokens_names_nulls_instead_of_arrow_invalid():
    from dataplane_rl.store import pad_tokens

    with pytest.raises(SchemaError, match="holds nulls"):
        pad_tokens(pa.array([[0.5, None], [1.0]], type=pa.list_(pa.float32())), torch=False)


def test_schema_validate_refuses_nan_rewards_and_null_token_ids(tmp_path):
    good = {c: grpo_columns(range(3), [c])[c] for c in ("input_lengths", "total_reward", "group_id")}
    table = pa.table({
        "input_lengths": pa.array(good["input_lengths"]),
        "input_ids": pa.array([[1] * int(n) for n in good["input_lengths"]][:2] + [[None] * int(good["input_lengths"][2])],
                              type=pa.list_(pa.int32())),
        "total_reward": pa.array([0.5, np.nan, 1.0], type=pa.float32()),
        "group_id": pa.array(good["group_id"]),
    })
    pq.write_table(table, tmp_path / "bad.parquet")
    p = subprocess.run([sys.executable, "-m", "dataplane_rl.cli.main", "schema", "validate", "--writer", "driver",
                        str(tmp_path / "bad.parquet")], capture_output=True, text=True, timeout=120)
    assert p.returncode == 1, p.stdout + p.stderr
    assert "column 'total_reward' rows 1: has NaN or infinite values" in p.stderr
    assert "column 'input_ids' rows 2: has null values inside token lists" in p.stderr


def test_non_finite_loss_stops_the_run_naming_step_and_metric(tmp_path, ray_session):
    from dataplane_rl.config import load_config
    from dataplane_rl.driver.loop import NonFiniteError, train

    run_dir = tmp_path / "nan"
    cfg = load_config(None, ["grpo.num_prompts_per_step=4", "grpo.num_generations_per_prompt=4", "grpo.max_num_steps=5",
                             "policy.train_global_batch_size=8", "policy.train_micro_batch_size=8",
                             "generation.max_new_tokens=4", "logger.progress=false", "policy.learning_rate=1e30",
                             "policy.max_grad_norm=1e30", f"logger.run_dir={run_dir}"])
    with pytest.raises(NonFiniteError, match=r"step \d: train/(loss|grad_norm|param_norm) is (nan|inf|-inf)"):
        train(cfg)
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["status"] == "failed" and "NonFiniteError: step" in summary["error"]
    logged = (run_dir / "metrics.jsonl").read_text().splitlines() if (run_dir / "metrics.jsonl").exists() else []
    assert summary["steps_completed"] == len(logged) < 5
    assert all("NaN" not in line and "Infinity" not in line for line in logged), "a non-finite step was logged"
