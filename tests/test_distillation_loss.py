"""The top-k distillation KL: hand-derived values, a plain-loop twin, microbatch / rank invariance (docs/distillation.md)."""

from __future__ import annotations

import math

import pytest
import torch

from dataplane_rl.algorithms.distillation import DISTILL_METRIC_NAMES, DistillationLoss, distillation_loss
from dataplane_rl.algorithms.loss import METRIC_NAMES, LossConfig
from dataplane_rl.config.distillation import DistillationConfig
from dataplane_rl.errors import MissingColumnError
from dataplane_rl.train.counts import local_counts
from test_loss import TinyPolicy, add_teacher, assert_same_step, close, make_batch, run_sharded

L = math.log
NAN = float("nan")


def hand_case():
    """One row of 3 positions, k = 2. Position 0 is masked and holds NaN.

    Position 1: teacher log-probs (ln .3, ln .1) renormalise to p = (.75, .25); the student's (ln .2, ln .2) to
    q = (.5, .5).
      forward = .75 ln(.75/.5) + .25 ln(.25/.5) = .75 * .405465 - .25 * .693147 = 0.130812
      reverse = .5 ln(.5/.75) + .5 ln(.5/.25)   = .5 * -.405465 + .5 * .693147  = 0.143841
      d forward / d s_j = q_j - p_j = (-.25, .25)
      d reverse / d s_j = q_j (ln(q_j/p_j) - reverse) = .5 (-.405465 - .143841), .5 (.693147 - .143841)
                        = (-.274653, .274653)
    Position 2: teacher (ln .5, ln .25) and student (ln .2, ln .1) both renormalise to (2/3, 1/3): KL 0, grad 0.
    N_tok = 2, so each value is halved. Masses: student (.4 + .3) / 2 = .35, teacher (.4 + .75) / 2 = .575.
    """
    student = torch.tensor([[[NAN, NAN], [L(.2), L(.2)], [L(.2), L(.1)]]], dtype=torch.float64, requires_grad=True)
    teacher = torch.tensor([[[NAN, NAN], [L(.3), L(.1)], [L(.5), L(.25)]]], dtype=torch.float64)
    valid = torch.tensor([[False, True, True]])
    return student, teacher, valid


FWD, REV = 0.75 * L(1.5) + 0.25 * L(0.5), 0.5 * L(0.5 / 0.75) + 0.5 * L(2.0)
G_REV = 0.5 * (L(0.5 / 0.75) - REV)


@pytest.mark.parametrize("kl_type,w,value,grad", [
    ("forward", 0.5, FWD, [-0.25, 0.25]),
    ("reverse", 0.5, REV, [G_REV, -G_REV]),
    # mixed, w = .3: .3 * forward + .7 * reverse, and the same mix of the gradients
    ("mixed", 0.3, 0.3 * FWD + 0.7 * REV, [0.3 * -0.25 + 0.7 * G_REV, 0.3 * 0.25 - 0.7 * G_REV]),
], ids=["forward", "reverse", "mixed"])
def test_hand_derived(kl_type, w, value, grad):
    student, teacher, valid = hand_case()
    term, m = distillation_loss(student, teacher, valid, n_tok=2, kl_type=kl_type, mixed_kl_weight=w)
    term.backward()
    close(FWD, 0.130812, rtol=1e-5)
    close(REV, 0.143841, rtol=1e-5)
    close(term, value / 2)
    close(m["distillation_loss"], value / 2)
    close(m["distillation_student_topk_mass"], 0.35)
    close(m["distillation_teacher_topk_mass"], 0.575)
    close(student.grad, [[[0.0, 0.0], [grad[0] / 2, grad[1] / 2], [0.0, 0.0]]], atol=1e-12)


def test_combined_with_the_task_loss():
    # loss = kl_loss_weight * KL + task_loss_weight * GRPO, the GRPO part ClippedPGLoss's own value
    policy = TinyPolicy()
    batch = add_teacher(make_batch(policy, B=8, T=6, seed=2), k=3, seed=4)
    counts = local_counts(batch)
    lp, at = policy(batch["input_ids"], batch["teacher_topk_ids"])
    cfg = DistillationConfig(kl_type="forward", task_loss_weight=0.25, kl_loss_weight=3.0)
    loss, m = DistillationLoss(cfg, LossConfig())(lp, batch, counts, at)
    assert set(m) == set(METRIC_NAMES) | set(DISTILL_METRIC_NAMES) | {"task_loss"}
    kl, _ = distillation_loss(at, batch["teacher_topk_logprobs"], (batch["token_mask"] != 0) & (batch["sample_mask"] != 0)[:, None],
                              counts.tokens, "forward")
    close(m["distillation_loss"], kl)
    close(loss, 0.25 * m["task_loss"] + 3.0 * kl)
    close(m["loss"], loss)
    with pytest.raises(MissingColumnError, match="teacher_topk_logprobs"):
        DistillationLoss(cfg)(lp, {k: v for k, v in batch.items() if k != "teacher_topk_logprobs"}, counts, at)


def loop_kl(student, teacher, valid, n_tok, kl_type, w):
    """The same loss one position and one id at a time, with plain floats' formulas on 0-dim tensors."""
    total = 0.0
    B, T, k = student.shape
    for i in range(B):
        for t in range(T):
            if not valid[i, t]:
                continue
            zs = sum(torch.exp(student[i, t, j]) for j in range(k))
            zt = sum(math.exp(float(teacher[i, t, j])) for j in range(k))
            fwd = rev = 0.0
            for j in range(k):
                q = torch.exp(student[i, t, j]) / zs
                p = math.exp(float(teacher[i, t, j])) / zt
                fwd = fwd + p * (math.log(p) - torch.log(q))
                rev = rev + q * (torch.log(q) - math.log(p))
            total = total + {"forward": fwd, "reverse": rev, "mixed": w * fwd + (1 - w) * rev}[kl_type]
    return total / max(n_tok, 1)


@pytest.mark.parametrize("kl_type", ["forward", "reverse", "mixed"])
@pytest.mark.parametrize("seed", [0, 1])
def test_loop_matches_vectorised(kl_type, seed):
    policy = TinyPolicy()
    batch = add_teacher(make_batch(policy, B=6, T=7, seed=seed, dead=2), k=5, seed=seed + 10)
    valid = (batch["token_mask"] != 0) & (batch["sample_mask"] != 0)[:, None]
    with torch.no_grad():
        at = policy(batch["input_ids"], batch["teacher_topk_ids"])[1]  # [B, T, k]
    a, b = at.clone().requires_grad_(True), at.clone().requires_grad_(True)
    n = int(valid.sum())
    term, _ = distillation_loss(a, batch["teacher_topk_logprobs"], valid, n, kl_type, 0.4)
    term.backward()
    ref = loop_kl(b, batch["teacher_topk_logprobs"], valid, n, kl_type, 0.4)
    ref.backward()
    assert float(term.detach()) > 0
    close(term, ref)
    close(a.grad, b.grad)


@pytest.fixture(scope="module")
def reference():
    torch.manual_seed(0)
    policy = TinyPolicy()
    batch = add_teacher(make_batch(policy, seed=3), k=4, seed=5)
    fn = DistillationLoss(DistillationConfig(kl_type="mixed", mixed_kl_weight=0.3, task_loss_weight=0.5),
                          LossConfig(reference_policy_kl_penalty=0.2, positive_example_nll_weight=0.3))
    return policy, batch, fn, run_sharded(policy, batch, fn, 1, 1)


@pytest.mark.parametrize("n_ranks", [1, 2, 4])
@pytest.mark.parametrize("n_micro", [1, 3, 8])
def test_microbatch_and_rank_invariance(reference, n_ranks, n_micro):
    policy, batch, fn, want = reference
    assert want[1]["distillation_loss"] > 0 and want[1]["task_loss"] != 0
    assert_same_step(run_sharded(policy, batch, fn, n_ranks, n_micro), want)


def test_padding_does_not_change_the_loss():
    # packing and dynamic batching hand the loss rows padded to other widths: extra zero columns change nothing
    student, teacher, valid = hand_case()
    wide = lambda t, v: torch.cat([t, torch.full((1, 4, 2), v, dtype=t.dtype)], dim=1)  # noqa: E731
    term, _ = distillation_loss(student, teacher, valid, 2, "mixed")
    padded, _ = distillation_loss(wide(student.detach(), 0.0), wide(teacher, NAN),
                                  torch.cat([valid, torch.zeros(1, 4, dtype=torch.bool)], dim=1), 2, "mixed")
    close(padded, term)


def test_refuses_mismatched_shapes():
    student, teacher, valid = hand_case()
    with pytest.raises(ValueError, match=r"must both be \[B, T, k\]"):
        distillation_loss(student[..., :1], teacher, valid, 2, "forward")
    with pytest.raises(ValueError, match="unknown distillation.kl_type"):
        distillation_loss(student, teacher, valid, 2, "sideways")
