"""Bounded importance weights (tis, icepop, seq-mask-tis) and sequence masking by log-prob error (docs/loss.md).

Expected values are derived by hand in the comments; random batches are checked against the plain-loop twin of
tests/test_loss.py and for microbatch and rank invariance of the loss, its gradients and every metric.
"""

from __future__ import annotations

import math

import pytest
import torch
from pydantic import ValidationError

from dataplane_rl.algorithms.loss import METRIC_NAMES, ClippedPGLoss, LossConfig
from dataplane_rl.config import load_config
from dataplane_rl.errors import ConfigError, MissingColumnError
from dataplane_rl.train.counts import local_counts, reduce_metrics
from test_loss import TinyPolicy, assert_same_step, close, loop_loss, make_batch, one, run_sharded

L = math.log
IS = dict(use_importance_sampling_correction=True, reference_policy_kl_penalty=0.0)


def hand_batch():
    """Two sequences, A = 1, lp = prev (r = 1, so pg = -1 per token and its gradient is -w / N).

    Row 0: four response tokens with rho = exp(prev - gen) = 3, 0.4, 1.5, 1; slot 4 is padding.
    Row 1: a multi-turn row: tokens 0 and 2 are the model's (rho = 1.25, 0.8), token 1 is an observation
    (token_mask 0) whose generation log-prob is 40 nats off: it must enter no weight and no statistic.
    N_tok = 6, N_seq = 2.
    """
    rho = [[3.0, 0.4, 1.5, 1.0, 1.0], [1.25, math.exp(40.0), 0.8, 1.0, 1.0]]
    lp, batch = one([[-1.0] * 5, [-1.0] * 5], advantages=[1.0, 1.0],
                    token_mask=[[1, 1, 1, 1, 0], [1, 0, 1, 0, 0]])
    batch["generation_logprobs"] = torch.tensor([[-1.0 - L(r) for r in row] for row in rho], dtype=torch.float64)
    return lp, batch


def run(cfg: LossConfig, threshold=None):
    lp, batch = hand_batch()
    written = batch["sample_mask"].clone()
    fn = ClippedPGLoss(cfg, threshold)
    loss, m = fn(lp, batch, local_counts(batch, threshold))
    loss.backward()
    assert torch.equal(batch["sample_mask"], written)  # a derived mask: the column is never rewritten
    return loss, reduce_metrics([m]), lp.grad


# The sequence errors are the same for every case: mean over the valid tokens of exp|gen - prev| = exp|log rho|:
#   row 0: (3 + 1/0.4 + 1.5 + 1) / 4 = (3 + 2.5 + 1.5 + 1) / 4 = 2.0;  row 1: (1.25 + 1/0.8) / 2 = 1.25
#   mean = (2 + 1.25) / 2 = 1.625, max = 2 (the observation's e^40 would have made both huge).
def check_errors(m, masked=0):
    close(m["mean_seq_mult_prob_error"], 1.625)
    close(m["max_seq_mult_prob_error"], 2.0)
    close(m["num_masked_seqs"], masked)


def test_tis_truncates_above():
    # ratio 2: w = min(rho, 2) = [2, 0.4, 1.5, 1 | 1.25, 0.8], sum 6.95; only the 3 is truncated: oob 1/6.
    # pg_loss = -6.95 / 6; grad = -w / 6. Mean of w^2 = (4 + 0.16 + 2.25 + 1 + 1.5625 + 0.64) / 6 = 9.6125 / 6;
    # ESS = (6.95/6)^2 / (9.6125/6) = 6.95^2 / (6 * 9.6125).
    loss, m, grad = run(LossConfig(truncated_importance_sampling_type="tis", truncated_importance_sampling_ratio=2.0, **IS))
    close(loss, -6.95 / 6)
    close(grad, [[-2 / 6, -0.4 / 6, -1.5 / 6, -1 / 6, 0.0], [-1.25 / 6, 0.0, -0.8 / 6, 0.0, 0.0]])
    close(m["sampling_importance_ratio"], 6.95 / 6)
    close(m["is_weight_sq_mean"], 9.6125 / 6)
    close(m["is_eff_sample_size"], 6.95 ** 2 / (6 * 9.6125))
    close(m["is_oob_ratio"], 1 / 6)
    close(m["is_masked_seqs"], 0)
    check_errors(m)


def test_icepop_masks_outside_both_bounds():
    # [0.5, 2]: 3 (above) and 0.4 (below) get 0: w = [0, 0, 1.5, 1 | 1.25, 0.8], sum 4.55, oob 2/6.
    loss, m, grad = run(LossConfig(truncated_importance_sampling_type="icepop", truncated_importance_sampling_ratio=2.0,
                                   truncated_importance_sampling_ratio_min=0.5, **IS))
    close(loss, -4.55 / 6)
    close(grad, [[0.0, 0.0, -1.5 / 6, -1 / 6, 0.0], [-1.25 / 6, 0.0, -0.8 / 6, 0.0, 0.0]])
    close(m["sampling_importance_ratio"], 4.55 / 6)
    close(m["is_oob_ratio"], 2 / 6)
    check_errors(m)


def test_seq_mask_tis_masks_whole_sequences_by_geometric_mean():
    # geometric means: row 0 (3 * 0.4 * 1.5 * 1)^(1/4) = 1.8^0.25 = 1.158 > 1.01: every token 0;
    # row 1 (1.25 * 0.8)^(1/2) = 1 in [0.99, 1.01] (the observation's e^40 would push it out): w = rho, untruncated.
    # w = [0, 0, 0, 0 | 1.25, 0.8]: loss -2.05 / 6 (N_tok keeps row 0: an IS weight, not a sample mask), oob 4/6.
    loss, m, grad = run(LossConfig(truncated_importance_sampling_type="seq-mask-tis", truncated_importance_sampling_ratio=1.01,
                                   truncated_importance_sampling_ratio_min=0.99, **IS))
    close(loss, -2.05 / 6)
    close(grad, [[0.0] * 5, [-1.25 / 6, 0.0, -0.8 / 6, 0.0, 0.0]])
    close(m["is_oob_ratio"], 4 / 6)
    close(m["is_masked_seqs"], 1)
    close(m["is_eff_sample_size"], (2.05 / 6) ** 2 / ((1.25 ** 2 + 0.8 ** 2) / 6))
    check_errors(m)


def test_seq_logprob_error_threshold_takes_sequences_out_of_the_normalisers():
    # threshold 1.5: row 0's error 2.0 passes it and leaves the loss: N_tok = 2, N_seq = 1, 1 masked.
    # tis ratio 2 on row 1: w = [1.25, 0.8]: loss = -2.05 / 2, grad -w / 2; the errors are still those of both
    # written rows (mean 1.625 over 2, max 2).
    cfg = LossConfig(truncated_importance_sampling_type="tis", truncated_importance_sampling_ratio=2.0, **IS)
    lp, batch = hand_batch()
    counts = local_counts(batch, 1.5)
    assert (counts.tokens, counts.sequences, counts.masked_sequences) == (2, 1, 1)
    loss, m, grad = run(cfg, threshold=1.5)
    close(loss, -2.05 / 2)
    close(grad, [[0.0] * 5, [-1.25 / 2, 0.0, -0.8 / 2, 0.0, 0.0]])
    close(m["num_valid_tokens"], 2)
    close(m["sampling_importance_ratio"], 2.05 / 2)
    check_errors(m, masked=1)
    # a threshold above every error masks nothing and changes nothing
    same, m2, _ = run(cfg, threshold=2.5)
    close(same, -6.95 / 6)
    check_errors(m2)


def test_null_type_is_the_unbounded_weight_bit_for_bit():
    # tis with a bound no weight reaches takes the same path values as the null type: w = rho exactly.
    policy = TinyPolicy()
    batch = make_batch(policy, B=16, T=9, seed=4)
    with torch.no_grad():
        lp0 = policy(batch["input_ids"])  # [B, T]
    got = []
    for cfg in (LossConfig(use_importance_sampling_correction=True),
                LossConfig(use_importance_sampling_correction=True, truncated_importance_sampling_type="tis",
                           truncated_importance_sampling_ratio=1e30)):
        lp = lp0.clone().requires_grad_(True)
        loss, m = ClippedPGLoss(cfg)(lp, batch, local_counts(batch))
        loss.backward()
        got.append((loss, lp.grad, m))
    assert torch.equal(got[0][0], got[1][0]) and torch.equal(got[0][1], got[1][1])
    assert float(got[0][2]["is_oob_ratio"]) == 0.0
    # the null weight is today's: exp(prev - gen) on valid tokens, reported as its mean
    valid = (batch["token_mask"] != 0) & (batch["sample_mask"] != 0)[:, None]
    rho = torch.where(valid, (batch["prev_logprobs"] - batch["generation_logprobs"]).exp(), 0.0)
    close(got[0][2]["sampling_importance_ratio"], rho.sum() / valid.sum())


def test_threshold_needs_generation_logprobs():
    lp, batch = hand_batch()
    del batch["generation_logprobs"]
    with pytest.raises(MissingColumnError, match="seq_logprob_error_threshold"):
        ClippedPGLoss(LossConfig(reference_policy_kl_penalty=0.0), 1.5)(lp, batch, local_counts(batch))


# ---------------------------------------------------------------- random batches: loop twin and invariance

BASE = dict(ratio_clip_min=0.1, ratio_clip_max=0.15, ratio_clip_c=2.0, reference_policy_kl_penalty=0.2,
            positive_example_nll_weight=0.3, use_importance_sampling_correction=True)
# log rho ~ N(0, 0.2) per token in make_batch: these bounds truncate or mask a share of tokens and sequences
TIS_CASES = {
    "tis": (LossConfig(truncated_importance_sampling_type="tis", truncated_importance_sampling_ratio=1.2, **BASE), None),
    "icepop": (LossConfig(truncated_importance_sampling_type="icepop", truncated_importance_sampling_ratio=1.2,
                          truncated_importance_sampling_ratio_min=0.8, **BASE), None),
    "seq-mask-tis+threshold": (LossConfig(truncated_importance_sampling_type="seq-mask-tis", truncated_importance_sampling_ratio=1.05,
                                          truncated_importance_sampling_ratio_min=0.95, **BASE), 1.2),
    "icepop+threshold,sequence": (LossConfig(truncated_importance_sampling_type="icepop", truncated_importance_sampling_ratio=1.2,
                                             truncated_importance_sampling_ratio_min=0.8, token_level_loss=False,
                                             **BASE), 1.25),
}


@pytest.mark.parametrize("name", sorted(TIS_CASES))
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_loop_twin_on_random_batches(name, seed):
    cfg, threshold = TIS_CASES[name]
    policy = TinyPolicy()
    batch = make_batch(policy, B=24, T=9, seed=seed)
    with torch.no_grad():
        lp0 = policy(batch["input_ids"])  # [B, T]
    counts = local_counts(batch, threshold)
    lp = lp0.clone().requires_grad_(True)
    loss, m = ClippedPGLoss(cfg, threshold)(lp, batch, counts)
    loss.backward()
    lp_loop = lp0.clone().requires_grad_(True)
    ref_loss, ref = loop_loss(cfg, lp_loop, batch, counts, threshold)
    ref_loss.backward()
    close(loss, ref["loss"])
    for k in METRIC_NAMES:
        close(m[k], ref[k])
    close(lp.grad, lp_loop.grad)


@pytest.fixture(scope="module")
def reference():
    cache = {}

    def get(name):
        if name not in cache:
            torch.manual_seed(0)
            policy = TinyPolicy()
            batch = make_batch(policy, seed=3)
            cfg, threshold = TIS_CASES[name]
            cache[name] = (policy, batch, run_sharded(policy, batch, cfg, 1, 1, threshold))
        return cache[name]
    return get


@pytest.mark.parametrize("n_ranks", [1, 2, 4])
@pytest.mark.parametrize("n_micro", [1, 3, 32])
@pytest.mark.parametrize("name", sorted(TIS_CASES))
def test_microbatch_and_rank_invariance(reference, name, n_ranks, n_micro):
    policy, batch, (ref_loss, ref, ref_grads) = reference(name)
    cfg, threshold = TIS_CASES[name]
    # the reference is not trivial: weights bounded, errors measured, sequences masked where asked
    assert 0 < ref["is_oob_ratio"] < 1 and 0 < ref["is_eff_sample_size"] < 1
    assert 1 < ref["mean_seq_mult_prob_error"] < ref["max_seq_mult_prob_error"]
    assert (ref["num_masked_seqs"] > 0) == (threshold is not None)
    assert (ref["is_masked_seqs"] > 0) == (cfg.truncated_importance_sampling_type == "seq-mask-tis")
    assert_same_step(run_sharded(policy, batch, cfg, n_ranks, n_micro, threshold), (ref_loss, ref, ref_grads))


def test_max_metric_is_max_reduced_not_summed():
    got = reduce_metrics([{"max_seq_mult_prob_error": torch.tensor(1.5), "num_masked_seqs": 1.0},
                          {"max_seq_mult_prob_error": torch.tensor(2.5), "num_masked_seqs": 2.0}])
    assert got == {"max_seq_mult_prob_error": 2.5, "num_masked_seqs": 3.0}


# ---------------------------------------------------------------- config errors, before anything starts

@pytest.mark.parametrize("overrides,match", [
    (["loss_fn.truncated_importance_sampling_type=tis", "loss_fn.truncated_importance_sampling_ratio=2.0"],
     "truncated_importance_sampling_type=tis .*loss_fn.use_importance_sampling_correction=true"),
    (["loss_fn.use_importance_sampling_correction=true", "loss_fn.truncated_importance_sampling_type=tis"],
     "needs an upper bound loss_fn.truncated_importance_sampling_ratio"),
    (["loss_fn.use_importance_sampling_correction=true", "loss_fn.truncated_importance_sampling_type=icepop",
      "loss_fn.truncated_importance_sampling_ratio=5.0"], "needs a lower bound loss_fn.truncated_importance_sampling_ratio_min"),
    (["loss_fn.use_importance_sampling_correction=true", "loss_fn.truncated_importance_sampling_type=seq-mask-tis",
      "loss_fn.truncated_importance_sampling_ratio=0.99", "loss_fn.truncated_importance_sampling_ratio_min=1.01"],
     "ratio_min=1.01 is above loss_fn.truncated_importance_sampling_ratio=0.99"),
    (["loss_fn.use_importance_sampling_correction=true", "loss_fn.truncated_importance_sampling_type=tis",
      "loss_fn.truncated_importance_sampling_ratio=2.0", "loss_fn.truncated_importance_sampling_ratio_min=0.5"],
     "ratio_min=0.5 is unused by loss_fn.truncated_importance_sampling_type=tis"),
    (["loss_fn.truncated_importance_sampling_ratio=2.0"], "truncated_importance_sampling_type is null"),
    (["loss_fn.truncated_importance_sampling_type=clip"], "truncated_importance_sampling_type"),
    (["grpo.seq_logprob_error_threshold=0.5"], "grpo.seq_logprob_error_threshold"),
    (["grpo.seq_logprob_error_threshold=2.0", "data_plane.train_fields=[input_ids,input_lengths,token_mask,"
      "sample_mask,prev_logprobs,advantages]", "loss_fn.reference_policy_kl_penalty=0.0"], "generation_logprobs"),
])
def test_config_errors_name_the_keys(overrides, match):
    with pytest.raises(ConfigError, match=match) as e:
        load_config(None, overrides)
    assert "\n" not in str(e.value)  # one `error:` line on the CLI


def test_loss_config_refuses_alone_too():
    with pytest.raises(ValidationError, match="ratio_min"):
        LossConfig(use_importance_sampling_correction=True, truncated_importance_sampling_type="icepop",
                   truncated_importance_sampling_ratio=2.0)
    ok = load_config(None, ["loss_fn.use_importance_sampling_correction=true", "grpo.seq_logprob_error_threshold=2.5",
                            "loss_fn.truncated_importance_sampling_type=icepop",
                            "loss_fn.truncated_importance_sampling_ratio=5.0",
                            "loss_fn.truncated_importance_sampling_ratio_min=0.5",
                            "loss_fn.reference_policy_kl_penalty=0.0"])
    # the accepted keys reach the loss as the train rank builds it (ClippedPGLoss(cfg.loss_fn, threshold)): icepop in
    # [0.5, 5] zeroes only the 0.4 of the hand batch, w = [3, 0, 1.5, 1 | 1.25, 0.8], sum 7.55, oob 1/6; the
    # threshold 2.5 is above both rows' errors and masks none
    loss, m, grad = run(ok.loss_fn, ok.grpo.seq_logprob_error_threshold)
    close(loss, -7.55 / 6)
    close(grad, [[-3 / 6, 0.0, -1.5 / 6, -1 / 6, 0.0], [-1.25 / 6, 0.0, -0.8 / 6, 0.0, 0.0]])
    close(m["is_oob_ratio"], 1 / 6)
    check_errors(m)
