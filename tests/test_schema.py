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


# -- a shape that names a config value (schema/grpo.yaml: teacher_topk_* have [distillation.topk_logits_k]) ----
def test_a_shape_names_a_config_value_and_a_run_binds_it():
    from dataplane_rl.config import bound_schema, load_config

    col = GRPO_SCHEMA.column("teacher_topk_ids")
    assert col.shape == ("distillation.topk_logits_k",) and col.shape_text == "[distillation.topk_logits_k]"
    assert not GRPO_SCHEMA.bound and GRPO_SCHEMA.column("input_ids").bound
    with pytest.raises(SchemaError, match=r"'teacher_topk_ids' has shape \[distillation.topk_logits_k\].*bound"):
        col.arrow_type  # no Arrow type until a config gives k
    cfg = load_config(None, ["distillation.topk_logits_k=16"])
    bound = cfg.run_schema()
    assert bound.bound and bound is cfg.run_schema()  # bound once per value, not per call
    assert bound.column("teacher_topk_ids").arrow_type == pa.list_(pa.list_(pa.int32(), 16))
    assert bound.column("teacher_topk_logprobs").shape == (16,)
    assert bound.names == GRPO_SCHEMA.names and bound.field_sets == GRPO_SCHEMA.field_sets
    assert bound_schema().column("teacher_topk_ids").shape == (64,)  # without a config: the key's default
    assert GRPO_SCHEMA.bind({"distillation": {"topk_logits_k": 3}}).column("teacher_topk_ids").shape == (3,)
    plain = GRPO_SCHEMA.bind({"distillation": {"topk_logits_k": 3}})
    assert plain.bind({}) is plain  # a schema whose shapes name nothing is its own binding


@pytest.mark.parametrize("shape,values,match", [
    ("[distillation.topk_logit_k]", None, r"names 'distillation.topk_logit_k', which is not a config key "
                                          r"\('topk_logit_k' not found \(did you mean 'topk_logits_k'\?\)\)"),
    ("[policy.model]", None, r"names 'policy.model', which is 'tiny' in this config, not a whole number >= 1"),
    ("[d.k]", {"d": {"k": 0}}, r"names 'd.k', which is 0 in this config, not a whole number >= 1"),
    ("[d.k]", {"d": {"k": True}}, r"which is True in this config"),
    ("[d.k, 8]", {"d": {"k": 1 << 18}}, r"bound to the config \(d.k=262144\): .*at most 1048576 values per token"),
])
def test_a_bad_binding_is_one_error_naming_the_file_column_and_key(tmp_path, shape, values, match):
    from dataplane_rl.config import Config

    p = tmp_path / "s.yaml"
    p.write_text(BASE + f"  - {{name: top, dtype: float32, kind: token, writer: teacher, shape: {shape}}}\n")
    schema = load_schema(p)
    with pytest.raises(SchemaError, match=match) as e:
        schema.bind(Config() if values is None else values)
    assert str(e.value).startswith(f"schema file '{p}'") and "column 'top'" in str(e.value)


@pytest.mark.parametrize("shape", ["[Distillation.k]", "[topk]", "['16']", "[distillation.]"])
def test_a_shape_names_only_dotted_config_keys(tmp_path, shape):
    p = tmp_path / "s.yaml"
    p.write_text(BASE + f"  - {{name: top, dtype: float32, kind: token, writer: teacher, shape: {shape}}}\n")
    with pytest.raises(SchemaError, match=r"must list whole numbers .* or config keys"):
        load_schema(p)


def test_a_run_refuses_a_bad_binding_before_it_starts(tmp_path):
    """The run's config validation binds data_plane.schema: a key its shape names that is not a number is one
    ConfigError naming the schema file, the column and the key."""
    from dataplane_rl.config import load_config
    from dataplane_rl.errors import ConfigError
    from dataplane_rl.schema import schema_path

    p = tmp_path / "mine.yaml"
    p.write_text(schema_path("grpo").read_text().replace("shape: [distillation.topk_logits_k]", "shape: [grpo.seed]", 1))
    with pytest.raises(ConfigError, match=rf"schema file '{p}' column 'teacher_topk_logprobs': shape names "
                                          r"'grpo.seed', which is 0 in this config") as e:
        load_config(None, [f"data_plane.schema={p}", "grpo.seed=0"])
    assert "\n" not in str(e.value)
