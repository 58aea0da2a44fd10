"""rollout_columns builds token columns flat (values + row lengths): the same rows as one array per row."""

from __future__ import annotations

import types
from dataclasses import dataclass

import numpy as np
import pyarrow as pa

from dataplane_rl.rollout.retries import Retries
from dataplane_rl.rollout.worker import rollout_columns


@dataclass
class Gen:
    tokens: list
    logprobs: list
    truncated: bool


class Tok:
    def decode(self, tokens, skip_special_tokens=True):
        return " ".join(map(str, tokens))


class Task:
    def reward(self, prompt, response):
        return float(len(response))


def test_token_columns_are_prompt_then_response_per_row():
    job = types.SimpleNamespace(group_ids=[5, 9], prompts=["a", "bb"])
    gens = [Gen([7, 8], [-0.5, -0.25], False), Gen([], [], True), Gen([4], [-1.0], False), Gen([1, 2, 3], [-1, -2, -3], True)]
    t = rollout_columns(job, gens, [[1, 2], [3]], ["a", "bb"], Tok(), Task(), 2, 4, Retries(0))
    # rows: prompt [1, 2] + [7, 8]; [1, 2] + []; prompt [3] + [4]; [3] + [1, 2, 3]
    assert t.column("input_ids").to_pylist() == [[1, 2, 7, 8], [1, 2], [3, 4], [3, 1, 2, 3]]
    assert t.column("input_lengths").to_pylist() == [4, 2, 2, 4]
    assert t.column("token_mask").to_pylist() == [[0, 0, 1, 1], [0, 0], [0, 1], [0, 1, 1, 1]]
    assert t.column("generation_logprobs").to_pylist() == [[0, 0, -0.5, -0.25], [0, 0], [0, -1], [0, -1, -2, -3]]
    assert t.column("total_reward").to_pylist() == [3.0, 0.0, 1.0, 5.0]  # len("7 8"), len(""), ...
    assert t.column("group_id").to_pylist() == [5, 5, 9, 9] and t.column("truncated").to_pylist() == [False, True, False, True]
    assert t.column("generation_policy_version").to_pylist() == [4] * 4
    assert t.schema.field("input_ids").type == pa.list_(pa.int32()) and t.schema.field("token_mask").type == pa.list_(pa.int8())
    assert np.asarray(t.column("generation_logprobs").combine_chunks().values).dtype == np.float32
    # a single turn: the prompt is turn 0 and the response turn 1, no observation, the end as the engine said
    assert t.column("turn_index").to_pylist() == t.column("token_mask").to_pylist()
    assert t.column("num_turns").to_pylist() == [1] * 4 and t.column("observation_tokens").to_pylist() == [0] * 4
    assert t.column("end_reason").to_pylist() == ["done", "length", "done", "length"]
    # a task without rows: no dataset row, no ground truth, no reward extras
    assert t.column("dataset_row").to_pylist() == [-1] * 4 and t.column("ground_truth").to_pylist() == ["null"] * 4
    assert t.column("reward_extra_info").to_pylist() == ["{}"] * 4 and t.column("prompt_text").to_pylist() == ["a", "a", "bb", "bb"]
    # token_policy_version: -1 on the prompt, the job's version on every sampled token (no refit inside the job)
    assert t.column("token_policy_version").to_pylist() == [[-1, -1, 4, 4], [-1, -1], [-1, 4], [-1, 4, 4, 4]]


def test_a_row_is_as_old_as_its_oldest_token():
    """With in-flight weight updates a row's tokens may span versions: generation_policy_version is the oldest."""
    job = types.SimpleNamespace(group_ids=[5], prompts=["a"])
    gens = [Gen([7, 8, 9], [-0.5, -0.25, -1.0], False), Gen([], [], True)]
    t = rollout_columns(job, gens, [[1, 2]], ["a"], Tok(), Task(), 2, 3, Retries(0), versions=[[3, 4, 5], []])
    assert t.column("token_policy_version").to_pylist() == [[-1, -1, 3, 4, 5], [-1, -1]]
    assert t.column("generation_policy_version").to_pylist() == [3, 3]


def test_schema_table_takes_every_type_from_the_schema():
    """The rollout's tables (single- and multi-turn) come from plain values through store.schema_table: each
    column gets the Arrow type schema/grpo.yaml declares, token columns from one sequence per row or flat with the
    lengths alike, and an unknown column is the schema's error naming it."""
    import pytest

    from dataplane_rl.errors import SchemaError
    from dataplane_rl.schema import GRPO_SCHEMA
    from dataplane_rl.store import schema_table

    values = {"input_ids": [[1, 2], [3]], "input_lengths": [2, 1], "token_mask": [[0, 1], [1]],
              "generation_logprobs": [[0.0, -0.5], [-1.25]], "total_reward": [1, 0], "group_id": [7, 7],
              "truncated": [True, False], "end_reason": ["length", "done"]}
    t = schema_table(GRPO_SCHEMA, values)
    assert t.column_names == list(values)
    assert [f.type for f in t.schema] == [GRPO_SCHEMA.column(n).arrow_type for n in values]
    GRPO_SCHEMA.check(t)  # every value, length and type as declared
    flat = schema_table(GRPO_SCHEMA, {"input_ids": [1, 2, 3], "generation_logprobs": np.array([0.0, -0.5, -1.25])},
                        lengths=[2, 1])
    assert flat.column("input_ids").equals(t.column("input_ids"))
    assert flat.column("generation_logprobs").to_pylist() == [[0.0, -0.5], [-1.25]]
    with pytest.raises(SchemaError, match="no column 'input_idz'.*did you mean 'input_ids'"):
        schema_table(GRPO_SCHEMA, {"input_idz": [[1]]})
