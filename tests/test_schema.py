"""The declared schema: loading, field sets, aliases, Arrow types, batch validation, bad files."""

import numpy as np
import pyarrow as pa
import pytest

from dataplane_rl.errors import AlignmentError, SchemaError
from dataplane_rl.schema import (
    ALIASES, DP_TRAIN_FIELDS, DRIVER_FIELDS, GRPO_SCHEMA, apply_aliases, load_schema,
)


def test_train_fields_come_from_the_file_and_carry_rewards():
    import yaml

    from dataplane_rl.resources import data_dir

    raw = yaml.safe_load((data_dir("schema") / "grpo.yaml").read_text())
    assert DP_TRAIN_FIELDS == tuple(raw["field_sets"]["DP_TRAIN_FIELDS"])
    assert "total_reward" in DP_TRAIN_FIELDS
    assert ALIASES == {"total_reward": "rewards"}
    assert apply_aliases({"total_reward": 1, "advantages": 2}) == {"rewards": 1, "advantages": 2}
    assert GRPO_SCHEMA.storage_name("rewards") == "total_reward"


def test_required_columns_are_declared():
    need = {"input_ids", "input_lengths", "token_mask", "generation_logprobs", "total_reward", "group_id",
            "truncated", "prompt_text", "response_text", "prev_logprobs", "reference_policy_logprobs",
            "advantages", "sample_mask"}
    assert need <= set(GRPO_SCHEMA.names)
    assert GRPO_SCHEMA.column("advantages").kind == "sample"
    assert all(GRPO_SCHEMA.column(f).kind == "sample" for f in DRIVER_FIELDS)


def test_arrow_schema_types():
    s = GRPO_SCHEMA.arrow_schema(["input_ids", "total_reward", "prompt_text"])
    assert s.field("input_ids").type == pa.list_(pa.int32())
    assert s.field("total_reward").type == pa.float32()
    assert s.field("prompt_text").type == pa.string()


def _batch(lengths=(3, 1), ids_lengths=None):
    ids_lengths = ids_lengths or lengths
    return {
        "input_lengths": pa.array(np.array(lengths, dtype=np.int32)),
        "input_ids": pa.array([list(range(n)) for n in ids_lengths], type=pa.list_(pa.int32())),
        "total_reward": pa.array([0.5] * len(lengths), type=pa.float32()),
    }


def test_valid_batch_has_no_violations():
    assert GRPO_SCHEMA.violations(_batch()) == []


def test_violations_name_column_and_rows():
    b = _batch(lengths=(3, 1, 2), ids_lengths=(3, 2, 2))
    b["total_reward"] = pa.array([1.0, 2.0, 3.0], type=pa.float64())
    b["bogus"] = pa.array([1, 2, 3])
    found = {v.column: v for v in GRPO_SCHEMA.violations(b)}
    assert "float64" in found["total_reward"].message and "float32" in found["total_reward"].message
    assert found["input_ids"].rows == (1,)
    assert "not declared" in found["bogus"].message
    with pytest.raises(SchemaError, match="input_ids"):
        GRPO_SCHEMA.check(b)


def test_unequal_row_counts_are_alignment_errors():
    b = _batch()
    b["total_reward"] = pa.array([0.5], type=pa.float32())
    with pytest.raises(AlignmentError, match="different row counts"):
        GRPO_SCHEMA.check(b)


def test_token_column_without_lengths_is_refused():
    b = {"input_ids": pa.array([[1, 2]], type=pa.list_(pa.int32()))}
    with pytest.raises(SchemaError, match="input_lengths"):
        GRPO_SCHEMA.check(b)
    GRPO_SCHEMA.check(b, lengths=np.array([2]))  # lengths from the store are accepted


BASE = """
name: t
columns:
  - {name: input_lengths, dtype: int32, kind: sample, writer: rollout}
  - {name: a, dtype: float32, kind: token, writer: rollout}
"""


@pytest.mark.parametrize("extra,match", [
    ("  - {name: b, dtype: float33, kind: sample, writer: rollout}\n", "unknown dtype 'float33'.*float32"),
    ("  - {name: a, dtype: int8, kind: sample, writer: rollout}\n", "duplicate column 'a'"),
    ("field_sets:\n  S: [a, nope]\n", "field set 'S' names undeclared column 'nope'"),
    ("aliases:\n  nope: rewards\n", "alias 'nope: rewards' names undeclared column 'nope'"),
    ("  - {name: b, dtype: int8, kind: sample, writer: trainer}\n", "writer"),
])
def test_bad_schema_files(tmp_path, extra, match):
    p = tmp_path / "s.yaml"
    p.write_text(BASE + extra)
    with pytest.raises(SchemaError, match=match) as e:
        load_schema(p)
    assert str(p) in str(e.value)


def test_missing_schema_file_and_name(tmp_path):
    with pytest.raises(SchemaError, match="not found"):
        load_schema(tmp_path / "nope.yaml")
    with pytest.raises(SchemaError, match="built-in: grpo"):
        load_schema("grpoo")


def test_custom_schema_loads(tmp_path):
    p = tmp_path / "s.yaml"
    p.write_text(BASE + "field_sets:\n  S: [a]\naliases:\n  a: alpha\n")
    s = load_schema(p)
    assert s.field_set("S") == ("a",) and s.apply_aliases({"a": 1}) == {"alpha": 1}
