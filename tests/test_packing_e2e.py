"""Packing and dynamic batching end to end give the padded run's numbers (docs/packing.md).

Three runs share every assertion (CI time is scarce): a padded reference (dp 2, data plane on), packing (dp 2,
data plane off) and dynamic batching (dp 1, data plane on, the default round of 64 on rows of ~10 tokens); all
with the VAPO term, grpo.num_epochs=2 and two steps. Step 1 agrees within 1e-5 relative, step 2 (after updates
whose float noise differs) within 1e-4.
"""

from __future__ import annotations

import math

import pytest
from test_train_e2e import TRAIN_KEYS, run

COMMON = ["grpo.max_num_steps=2", "grpo.num_epochs=2", "loss_fn.positive_example_nll_weight=0.1",
          "grpo.num_prompts_per_step=4", "policy.train_global_batch_size=8"]  # 16 rows: two global batches
MODES = {
    "padded": ["policy.dp_size=2", "data_plane.enabled=true"],
    "packed": ["policy.dp_size=2", "data_plane.enabled=false", "policy.sequence_packing.enabled=true",
               "policy.sequence_packing.train_mb_tokens=64", "policy.sequence_packing.logprob_mb_tokens=48"],
    "dynamic": ["policy.dp_size=1", "data_plane.enabled=true", "policy.dynamic_batching.enabled=true",
                "policy.dynamic_batching.train_mb_tokens=96"],  # the default round of 64: far longer than the rows
}
KEYS = TRAIN_KEYS + ("train/entropy", "train/clip_fraction_lower", "train/clip_fraction_upper", "train/ppo_kl",
                     "train/reward_std", "generation/response_length_mean", "generation/response_length_max",
                     "generation/prompt_length_mean", "generation/truncated_fraction")
NOISE = {"train/logprob_mismatch"}  # float noise by construction (see test_train_e2e.NOISE_KEYS)


@pytest.fixture(scope="module")
def runs(tmp_path_factory, ray_session):
    tmp = tmp_path_factory.mktemp("packing")
    return {name: run(tmp, name, *COMMON, *extra) for name, extra in MODES.items()}


@pytest.mark.parametrize("mode", ["packed", "dynamic"])
def test_same_numbers_as_padded(runs, mode):
    _, ref_m, ref_d = runs["padded"]
    summary, m, d = runs[mode]
    assert summary["status"] == "completed" and d == ref_d, "rollouts differ"
    for step, rel in ((0, 1e-5), (1, 1e-4)):
        for k in KEYS:
            a, b = ref_m[step][k], m[step][k]
            if k in NOISE:
                assert a < 1e-5 and b < 1e-5, f"{k}: {a} vs {b}"
            else:
                assert math.isclose(a, b, rel_tol=rel, abs_tol=1e-7), f"{mode} step {step + 1} {k}: {b} vs padded {a}"
    assert m[0]["train/optimizer_steps"] == ref_m[0]["train/optimizer_steps"] == 4  # 2 global batches x 2 epochs
    # what packing is for: the padded run computes padding, the packed one none, dynamic batching some
    assert ref_m[0]["train/padding_fraction"] > 0
    if mode == "packed":
        assert m[0]["train/padding_fraction"] == 0.0 and m[0]["train/rank_token_imbalance"] >= 1.0
    else:  # length-sorted cuts of 4 rows never pad more than any 4 rows (padded: each rank's 4 rows)
        assert all(m[s]["train/padding_fraction"] <= ref_m[s]["train/padding_fraction"] for s in (0, 1))


def test_metrics_users_look_for(runs):
    m = runs["padded"][1][0]
    assert 0 < m["generation/response_length_mean"] <= m["generation/response_length_max"] <= 6
    assert 0 <= m["generation/truncated_fraction"] <= 1 and m["generation/prompt_length_mean"] > 0
    assert m["train/reward_min"] <= m["train/reward"] <= m["train/reward_max"] and m["train/reward_std"] >= 0
    assert 0 <= m["train/zero_advantage_group_fraction"] <= 1
    assert m["throughput/train_tokens_per_s"] > 0 and m["throughput/generation_tokens_per_s"] > 0
    assert math.isclose(m["train/clip_fraction_lower"] + m["train/clip_fraction_upper"], m["train/clip_fraction"],
                        rel_tol=1e-6, abs_tol=1e-9)
    assert m["train/rank_token_imbalance"] >= 1.0


def test_a_row_over_the_budget_is_refused_before_training(tmp_path, ray_session):
    from dataplane_rl.errors import ConfigError

    with pytest.raises(ConfigError, match=r"has \d+ tokens, more than policy\.sequence_packing\.train_mb_tokens=8"):
        run(tmp_path, "over", "policy.sequence_packing.enabled=true", "policy.sequence_packing.train_mb_tokens=8",
            "grpo.num_prompts_per_step=2", "grpo.num_generations_per_prompt=2", "policy.train_global_batch_size=4",
            "policy.train_micro_batch_size=2")
    assert not (tmp_path / "over" / "metrics.jsonl").exists() or not (tmp_path / "over" / "metrics.jsonl").read_text()
