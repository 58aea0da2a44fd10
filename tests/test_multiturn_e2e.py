"""Multi-turn GRPO end to end (real Ray actors, real stores, the tiny model): the data plane on and off, ranks,
microbatches, packing and dynamic batching give the same numbers on multi-turn rows, and the trained tokens
are the policy's alone. One module-scoped baseline run; each other test is one more 1-step run."""

from __future__ import annotations

import math

import pytest
from test_train_e2e import assert_close, run

from dataplane_rl.model.load import build_tiny, load_tokenizer

GUESS = ["task.name=guess", "grpo.num_prompts_per_step=4", "grpo.num_generations_per_prompt=4",
         "policy.train_global_batch_size=8", "policy.train_micro_batch_size=4", "generation.max_new_tokens=1",
         "policy.max_total_sequence_length=48", "multi_turn.max_turns=3", "grpo.max_val_samples=8",
         "loss_fn.positive_example_nll_weight=0.1"]


@pytest.fixture(scope="module")
def baseline(tmp_path_factory, ray_session):
    return run(tmp_path_factory.mktemp("mt"), "base", *GUESS, "data_plane.enabled=true")


def test_multi_turn_run_trains_only_the_policys_tokens(baseline):
    summary, metrics, data = baseline
    m = metrics[-1]
    assert summary["status"] == "completed" and m["step"] == 1
    rows = data["step_000001.jsonl"]
    assert len(rows) == 16 and {r["end_reason"] for r in rows} <= {"done", "max_turns", "length"}
    assert all(1 <= r["num_turns"] <= 3 for r in rows)
    assert m["rollout/num_turns_mean"] == pytest.approx(sum(r["num_turns"] for r in rows) / 16)
    assert m["rollout/num_turns_max"] == max(r["num_turns"] for r in rows)
    # one sampled token per turn (generation.max_new_tokens=1): N_tok over the step's optimizer steps is the
    # sum of the rows' turns, and the tokens the environment appended are not in it
    assert m["train/global_valid_toks"] == sum(r["num_turns"] for r in rows)
    assert m["train/global_valid_toks"] == pytest.approx(m["generation/response_length_mean"] * 16)
    assert m["rollout/env_tokens_mean"] > 0 and 0 < m["rollout/policy_token_fraction"] < 1
    assert m["rollout/policy_token_fraction"] == pytest.approx(
        m["train/global_valid_toks"] / (m["train/global_valid_toks"] + 16 * m["rollout/env_tokens_mean"]))
    tok = load_tokenizer(build_tiny(0))  # observations are not prompt tokens
    assert m["generation/prompt_length_mean"] == len(tok("guess 0000 1-7:").input_ids)  # BOS: the tokenizer adds it
    rates = [m[f"rollout/{k}_rate"] for k in ("natural_termination", "max_turns_reached", "truncation")]
    assert math.isclose(sum(rates), 1.0) and m["rollout/natural_termination_rate"] == 1.0
    # the same weights in both engines: exp|gen - train| over trained tokens is 1 up to float rounding
    assert 1.0 <= m["train/token_mult_prob_error"] < 1 + 1e-4 and m["train/logprob_mismatch"] < 1e-4
    assert 0 <= m["validation/reward"] <= 1 and m["validation/num_samples"] == 8


def test_multi_turn_data_plane_off_gives_the_same_numbers(baseline, tmp_path):
    _, base_m, base_d = baseline
    _, m, d = run(tmp_path, "off", *GUESS, "data_plane.enabled=false")
    assert d == base_d
    assert_close(base_m[0], m[0], rel=0, abs_=0)


@pytest.mark.parametrize("override", [
    ["policy.dp_size=2", "policy.sequence_packing.enabled=true", "policy.sequence_packing.train_mb_tokens=64",
     "policy.sequence_packing.logprob_mb_tokens=64"],
    ["policy.train_micro_batch_size=1", "policy.dynamic_batching.enabled=true", "policy.dynamic_batching.train_mb_tokens=64",
     "policy.dynamic_batching.logprob_mb_tokens=64", "policy.dynamic_batching.sequence_length_round=8"],
], ids=["dp2-packing", "micro1-dynamic-batching"])
def test_multi_turn_ranks_packing_and_dynamic_batching_are_exact(baseline, tmp_path, override):
    _, base_m, base_d = baseline
    _, m, d = run(tmp_path, "p", *GUESS, "data_plane.enabled=true", *override)
    assert d == base_d
    assert_close(base_m[0], m[0])
    assert m[0]["train/global_valid_toks"] == base_m[0]["train/global_valid_toks"]
