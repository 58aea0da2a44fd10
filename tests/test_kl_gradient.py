"""The KL term's gradient by exact enumeration: on-policy, E_pi[grad loss] = grad KL(pi || pi_ref) for k1, k2, k3.

No sampling: a categorical policy over the whole (tiny) vocabulary, every token's loss gradient weighted
by its detached probability, against autograd of the exact KL.
"""

from __future__ import annotations

import pytest
import torch

from dataplane_rl.algorithms.loss import ClippedPGLoss, GlobalCounts, LossConfig

VOCAB = 11


def expected_kl_grad(kind: str, logits: torch.Tensor, ref_lp: torch.Tensor, out_clamp: float = 10.0) -> torch.Tensor:
    """sum over the whole vocabulary of pi(y).detach() * grad(per-token KL loss of token y), exactly.

    One row holds every token y once; the importance weight w = exp(lp_old - lp_gen) with lp_old = lp
    and lp_gen = 0 is the detached pi(y), and A = 0, beta = 1, N_tok = V: the loss is sum_y pi(y) kl_y / V.
    """
    lp = logits.log_softmax(-1)[None]  # [1, V]: log pi(y) for each y
    V = lp.shape[1]
    batch = {"token_mask": torch.ones(1, V, dtype=torch.int8), "sample_mask": torch.ones(1, dtype=torch.int8),
             "prev_logprobs": lp.detach(), "generation_logprobs": torch.zeros(1, V, dtype=torch.float64),
             "advantages": torch.zeros(1, dtype=torch.float64), "reference_policy_logprobs": ref_lp[None]}
    cfg = LossConfig(reference_policy_kl_penalty=1.0, reference_policy_kl_type=kind, kl_output_clamp_value=out_clamp,
                     use_importance_sampling_correction=True)
    loss, _ = ClippedPGLoss(cfg)(lp, batch, GlobalCounts(V, 1, 0))
    (grad,) = torch.autograd.grad(V * loss, logits)
    return grad  # [V]


@pytest.mark.parametrize("kind", ["k1", "k2", "k3"])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_expected_kl_gradient_is_the_kl_gradient(kind, seed):
    # On-policy, E_pi[grad loss] must equal grad KL(pi || pi_ref) = grad sum_y pi(y) (log pi(y) - log pi_ref(y)).
    g = torch.Generator().manual_seed(seed)
    logits = (1.5 * torch.randn(VOCAB, generator=g, dtype=torch.float64)).requires_grad_(True)  # [V]
    ref_lp = (1.5 * torch.randn(VOCAB, generator=g, dtype=torch.float64)).log_softmax(-1)  # [V]
    lp = logits.log_softmax(-1)
    (want,) = torch.autograd.grad((lp.exp() * (lp - ref_lp)).sum(), logits)
    assert (lp - ref_lp).abs().max() < 10 and want.abs().max() > 0.05  # no clamp active, a real gradient
    got = expected_kl_grad(kind, logits, ref_lp, out_clamp=1e6)
    torch.testing.assert_close(got, want, rtol=0, atol=1e-6)
    if kind == "k3":  # without the score term this is the forward KL's gradient: the test can tell
        (forward,) = torch.autograd.grad(-(ref_lp.exp() * logits.log_softmax(-1)).sum(), logits)
        assert (forward - want).abs().max() > 1e-2


@pytest.mark.parametrize("kind", ["k1", "k3"])
def test_expected_kl_gradient_with_output_clamp(kind):
    # "clamp the estimate, then weight": a token whose estimate is output-clamped still carries
    # k_clamped * grad log pi, so the expected gradient is that of E_pi[clamp(k)], the reported value.
    logits = torch.tensor([4.0, 0.0, -1.0, 1.0], dtype=torch.float64, requires_grad=True)
    lp = logits.log_softmax(-1)
    ref_lp = lp.detach() + torch.tensor([-5.0, 0.3, -0.2, 0.1], dtype=torch.float64)  # d = -5 -> k1 5, k3 4.0
    clamp = 2.0
    d = ref_lp - lp
    k = -d if kind == "k1" else torch.expm1(d) - d
    assert (k.abs() > clamp).any() and (k.abs() < clamp).any()
    (want,) = torch.autograd.grad((lp.exp() * k.clamp(-clamp, clamp)).sum(), logits)
    torch.testing.assert_close(expected_kl_grad(kind, logits, ref_lp, out_clamp=clamp), want, rtol=0, atol=1e-9)
