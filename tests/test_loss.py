"""ClippedPGLoss: hand-derived terms, a plain-loop twin, and microbatch / rank invariance (docs/loss.md).

Expected values are derived in the comments next to each case, as in torchtune's test_ppo_loss.py.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

from dataplane_rl.algorithms.loss import METRIC_NAMES, ClippedPGLoss, GlobalCounts, LossConfig
from dataplane_rl.errors import MissingColumnError, SchemaError
from dataplane_rl.train.counts import all_reduce_counts, local_counts, reduce_metrics

VOCAB = 11
TOKEN_KEYS = ("token_mask", "prev_logprobs", "reference_policy_logprobs", "generation_logprobs")


# ---------------------------------------------------------------- helpers (also used by test_loss_distributed)

class TinyPolicy(torch.nn.Module):
    """Embedding + linear + log_softmax: log p(token t | token t-1), gathered at the tokens."""

    def __init__(self, vocab: int = VOCAB, hidden: int = 8):
        super().__init__()
        self.embed = torch.nn.Embedding(vocab, hidden)
        self.head = torch.nn.Linear(hidden, vocab)
        self.double()

    def forward(self, ids: torch.Tensor, topk_ids: torch.Tensor | None = None):
        """[B, T] log-probs; with topk_ids [B, T, k] also the log-probs of the distribution predicting token t
        at those ids, [B, T, k] (the student's side of distillation)."""
        logp = self.head(torch.tanh(self.embed(ids[:, :-1]))).log_softmax(-1)  # [B, T-1, V]
        lp = logp.gather(-1, ids[:, 1:, None]).squeeze(-1)  # [B, T-1]
        lp = F.pad(lp, (1, 0))  # [B, T]: position 0 predicts nothing and is masked
        if topk_ids is None:
            return lp
        return lp, F.pad(logp.gather(-1, topk_ids[:, 1:].long()), (0, 0, 1, 0))  # [B, T, k]


def add_teacher(batch: dict, k: int = 4, seed: int = 0) -> dict:
    """A random teacher's top-k columns: sorted log-probs of a random distribution at distinct random ids;
    NaN where token_mask is 0 (the loss must select them away)."""
    g = torch.Generator().manual_seed(seed)
    B, T = batch["token_mask"].shape
    logits = 2.0 * torch.randn(B, T, VOCAB, generator=g, dtype=torch.float64)  # [B, T, V]
    vals, ids = logits.log_softmax(-1).topk(k, dim=-1)  # [B, T, k]
    off = (batch["token_mask"] == 0)[..., None]  # [B, T, 1]
    return {**batch, "teacher_topk_logprobs": vals.masked_fill(off, float("nan")), "teacher_topk_ids": ids}


def loss_of(fn, policy, sub: dict, counts):
    """One microbatch's loss: ClippedPGLoss, or DistillationLoss with the student's log-probs at the teacher's ids."""
    if "teacher_topk_ids" in sub and not isinstance(fn, ClippedPGLoss):
        lp, at = policy(sub["input_ids"], sub["teacher_topk_ids"])  # one forward: DDP counts them
        return fn(lp, sub, counts, at)
    return fn(policy(sub["input_ids"]), sub, counts)


def make_batch(policy: TinyPolicy, B: int = 64, T: int = 12, seed: int = 0, positive: bool = True, dead: int = 6) -> dict:
    """Random uneven prompt/response lengths; the first `dead` rows train on nothing; NaN in padding slots."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(VOCAB, (B, T), generator=g)  # [B, T]
    lengths = torch.randint(2, T + 1, (B,), generator=g)  # [B]
    prompt = torch.minimum(torch.randint(1, 4, (B,), generator=g), lengths - 1)  # [B], >= 1 masks position 0
    pos = torch.arange(T)
    response = (pos >= prompt[:, None]) & (pos < lengths[:, None])  # [B, T]
    token_mask = response.to(torch.int8)  # [B, T]
    sample_mask = (torch.rand(B, generator=g) > 0.2).to(torch.int8)  # [B]
    # so some microbatches and rank shards hold no valid token: half sample-masked, half with no response
    sample_mask[: dead // 2] = 0
    token_mask[dead // 2: dead] = 0
    rewards = torch.randn(B, generator=g, dtype=torch.float64)  # [B]
    rewards[::5] = 0.0  # reward exactly 0 is not positive
    if not positive:
        rewards = -rewards.abs()
    with torch.no_grad():
        lp = policy(ids)  # [B, T]
    noise = lambda s: s * torch.randn(B, T, generator=g, dtype=torch.float64)  # noqa: E731
    prev = lp + noise(0.4)  # [B, T]: ratios up to ~e^1.2, so both clip sides are hit
    pad = ~response
    batch = {
        "input_ids": ids,
        "token_mask": token_mask,
        "sample_mask": sample_mask,
        "advantages": 1.5 * torch.randn(B, generator=g, dtype=torch.float64),  # [B]
        "rewards": rewards,
        "prev_logprobs": prev.masked_fill(pad, float("nan")),
        "reference_policy_logprobs": (lp + noise(0.5)).masked_fill(pad, float("nan")),
        "generation_logprobs": (prev + noise(0.2)).masked_fill(pad, float("nan")),
    }
    return batch


def rows(batch: dict, idx: torch.Tensor) -> dict:
    return {k: v[idx] for k, v in batch.items()}


def run_sharded(policy, batch, cfg, n_ranks: int, n_micro: int, threshold=None):
    """Simulate D ranks x n_micro microbatches; DDP's gradient average is a mean over ranks. `cfg` is a
    LossConfig, or a loss object (DistillationLoss, which then brings its own threshold). `threshold`:
    grpo.seq_logprob_error_threshold, given to the loss and the counts alike."""
    fn = ClippedPGLoss(cfg, threshold) if isinstance(cfg, LossConfig) else cfg
    threshold = fn.seq_logprob_error_threshold
    shards = torch.tensor_split(torch.arange(batch["token_mask"].shape[0]), n_ranks)
    local = [local_counts(rows(batch, s), threshold) for s in shards]
    counts = GlobalCounts(sum(c.tokens for c in local), sum(c.sequences for c in local),
                          sum(c.positive_tokens for c in local), dp_size=n_ranks,
                          masked_sequences=sum(c.masked_sequences for c in local))
    loss_sum, metrics, rank_grads = 0.0, [], []
    for shard in shards:
        policy.zero_grad()
        for mb in torch.tensor_split(shard, n_micro):
            sub = rows(batch, mb)
            loss, m = loss_of(fn, policy, sub, counts)
            loss.backward()
            loss_sum += loss.item()
            metrics.append(m)
        rank_grads.append([p.grad.clone() for p in policy.parameters()])
    grads = [torch.stack(g).mean(0) for g in zip(*rank_grads)]
    return loss_sum / n_ranks, reduce_metrics(metrics), grads


def close(a, b, rtol=1e-5, atol=1e-10):
    torch.testing.assert_close(torch.as_tensor(a, dtype=torch.float64), torch.as_tensor(b, dtype=torch.float64),
                               rtol=rtol, atol=atol)


def one(lp, **cols):
    """A hand-built batch around per-token lists; unspecified columns get neutral values."""
    lp = torch.tensor(lp, dtype=torch.float64, requires_grad=True)  # [B, T]
    B, T = lp.shape
    batch = {"token_mask": torch.ones(B, T, dtype=torch.int8), "sample_mask": torch.ones(B, dtype=torch.int8),
             "prev_logprobs": lp.detach().clone(), "advantages": torch.zeros(B, dtype=torch.float64)}
    for k, v in cols.items():
        batch[k] = torch.as_tensor(v, dtype=torch.int8 if "mask" in k else torch.float64)
    return lp, batch


def call(cfg, lp, batch, counts=None):
    loss, m = ClippedPGLoss(cfg)(lp, batch, counts or local_counts(batch))
    loss.backward()
    return loss, m, lp.grad


PG_ONLY = dict(reference_policy_kl_penalty=0.0)
L = math.log


# ---------------------------------------------------------------- each term by hand

def test_clipping_both_sides():
    # eps = 0.2, so clip(r) lies in [0.8, 1.2]; position 0 masked; lp = -1 + log r, lp_old = -1.
    #   A=+1, r=1.5: max(-1.5, -1.2) = -1.2  clipped (above), grad 0
    #   A=+1, r=0.5: max(-0.5, -0.8) = -0.5  unclipped,        grad -A r / N = -0.5/4
    #   A=-1, r=0.5: max( 0.5,  0.8) =  0.8  clipped (below), grad 0
    #   A=-1, r=1.5: max( 1.5,  1.2) =  1.5  unclipped,        grad -A r / N = +1.5/4
    # pg_loss = (-1.2 - 0.5 + 0.8 + 1.5) / 4 = 0.15; clip_fraction = 2/4; ratio mean = 4/4 = 1
    lp, batch = one([[0.0, -1 + L(1.5), -1 + L(0.5)], [0.0, -1 + L(0.5), -1 + L(1.5)]],
                    prev_logprobs=[[0.0, -1.0, -1.0], [0.0, -1.0, -1.0]], advantages=[1.0, -1.0],
                    token_mask=[[0, 1, 1], [0, 1, 1]])
    loss, m, grad = call(LossConfig(**PG_ONLY), lp, batch)
    close(loss, 0.15)
    close(m["pg_loss"], 0.15)
    close(m["clip_fraction"], 0.5)
    close(m["dual_clip_fraction"], 0.0)
    close(m["probs_ratio_mean"], 1.0)
    close(m["num_valid_tokens"], 4)
    close(m["approx_entropy"], -(4 * -1 + L(1.5) * 2 + L(0.5) * 2) / 4)
    close(grad, [[0.0, 0.0, -0.5 / 4], [0.0, 0.0, 1.5 / 4]])


def test_clip_higher_is_asymmetric():
    # eps_low = 0.2, eps_high = 0.28: A=+1, r=1.25 stays unclipped (1.25 < 1.28): pg = -1.25, grad -1.25
    lp, batch = one([[L(1.25)]], prev_logprobs=[[0.0]], advantages=[1.0])
    loss, m, grad = call(LossConfig(ratio_clip_max=0.28, **PG_ONLY), lp, batch)
    close(loss, -1.25)
    close(m["clip_fraction"], 0.0)
    close(grad, [[-1.25]])


def test_dual_clip():
    # c = 3, eps = 0.2, lp_old = 0 so r = e^lp:
    #   A=-1, r=5:    max(5, 1.2) = 5 > -cA = 3 -> capped at 3, grad 0 (dual clip)
    #   A=-1, r=2:    max(2, 1.2) = 2 < 3       -> 2, grad -A r / N = 2/4
    #   A=+1, r=0.01: max(-0.01, -0.8) = -0.01  -> the cap only applies to A < 0, grad -0.01/4
    #   A=+1, r=1:    -1,                          grad -1/4
    # pg_loss = (3 + 2 - 0.01 - 1) / 4 = 0.9975; dual_clip_fraction = 1/4; clip_fraction = 0
    lp, batch = one([[L(5), L(2)], [L(0.01), 0.0]], prev_logprobs=[[0.0, 0.0], [0.0, 0.0]], advantages=[-1.0, 1.0])
    loss, m, grad = call(LossConfig(ratio_clip_c=3.0, **PG_ONLY), lp, batch)
    close(loss, 0.9975)
    close(m["dual_clip_fraction"], 0.25)
    close(m["clip_fraction"], 0.0)
    close(grad, [[0.0, 0.5], [-0.0025, -0.25]])


E = math.exp
KL_CASES = [
    # d = lp_ref - lp for tokens (0.5, -1, 30); default clamps: d to +-20, the estimate to +-10.
    #   k1 = -d:          -0.5, 1, -20 -> -10
    #   k2 = d^2/2:       0.125, 0.5, 200 -> 10
    #   k3 = e^d - 1 - d: e^0.5 - 1.5, e^-1, e^20 - 21 -> 10
    # gradient d/d(lp): k1 and k3 carry the score term k * s (s = exp(lp - lp.detach()), d s/d lp = 1):
    #   k1: 1 + k1 = 1 - d  -> 0.5, 2;      k2 (no s): -d -> -0.5, 1
    #   k3: -(e^d - 1) + k3 = -d -> -0.5, 1; the third token's d is input-clamped: no gradient at all
    ("k1", 20.0, 10.0, [-0.5, 1.0, -10.0], [0.5, 2.0, 0.0]),
    ("k2", 20.0, 10.0, [0.125, 0.5, 10.0], [-0.5, 1.0, 0.0]),
    ("k3", 20.0, 10.0, [E(0.5) - 1.5, E(-1), 10.0], [-0.5, 1.0, 0.0]),
    # input clamp 2, output clamp 1000: d = 30 -> 2, so k1 = -2, k2 = 2, k3 = e^2 - 3; clamped d has grad 0
    ("k1", 2.0, 1000.0, [-0.5, 1.0, -2.0], [0.5, 2.0, 0.0]),
    ("k2", 2.0, 1000.0, [0.125, 0.5, 2.0], [-0.5, 1.0, 0.0]),
    ("k3", 2.0, 1000.0, [E(0.5) - 1.5, E(-1), E(2) - 3], [-0.5, 1.0, 0.0]),
]


@pytest.mark.parametrize("kind,in_clamp,out_clamp,per_token,dkl_dlp", KL_CASES)
def test_kl_estimators_and_clamps(kind, in_clamp, out_clamp, per_token, dkl_dlp):
    # A = 0 so pg = 0; loss = beta * mean(kl); d(kl)/d(lp) as derived in KL_CASES.
    beta = 0.5
    lp, batch = one([[-1.0, -1.0, -1.0]], reference_policy_logprobs=[[-0.5, -2.0, 29.0]])
    cfg = LossConfig(reference_policy_kl_penalty=beta, reference_policy_kl_type=kind,
                     kl_input_clamp_value=in_clamp, kl_output_clamp_value=out_clamp)
    loss, m, grad = call(cfg, lp, batch)
    close(m["kl_penalty"], sum(per_token) / 3)
    close(loss, beta * sum(per_token) / 3)
    close(grad, [[beta * g / 3 for g in dkl_dlp]])


def test_positive_example_nll():
    # rewards (1, 0, 2): sample 1 is not positive; sample 2's second token is masked.
    # N_pos = 3, positive_nll_loss = (0.5 + 1.5 + 2) / 3 = 4/3 (unweighted by mu); loss = mu * 4/3.
    # grad on each positive token = -mu / N_pos, 0 elsewhere.
    mu = 0.1
    lp, batch = one([[-0.5, -1.5], [-3.0, -3.0], [-2.0, -9.0]], rewards=[1.0, 0.0, 2.0],
                    token_mask=[[1, 1], [1, 1], [1, 0]])
    counts = local_counts(batch)
    assert (counts.tokens, counts.positive_tokens) == (5, 3)
    loss, m, grad = call(LossConfig(positive_example_nll_weight=mu, **PG_ONLY), lp, batch, counts)
    close(m["positive_nll_loss"], 4 / 3)
    close(loss, mu * 4 / 3)
    close(grad, [[-mu / 3, -mu / 3], [0.0, 0.0], [-mu / 3, 0.0]])


def test_importance_sampling_correction():
    # A = 1, r = 1 (lp = lp_old), w = exp(lp_old - lp_gen) = 2 and 0.5: pg = -1 per token.
    # k1 with d = 0.5 -> -0.5 per token, beta = 1. Weighted: pg_loss = (-2 - 0.5)/2 = -1.25,
    # kl_penalty = (2 * -0.5 + 0.5 * -0.5)/2 = -0.625. grad = w * (-A r + beta * (1 + k1)) / N
    # = w * (-1 + 0.5) / 2 = (-0.5, -0.125); the PG-only grad: w * (-1) / 2 = (-1, -0.25).
    # w is detached: no grad to lp_gen.
    lp_rows = [[-1.0, -2.0]]
    gen = torch.tensor([[-1.0 - L(2), -2.0 + L(2)]], dtype=torch.float64, requires_grad=True)
    lp, batch = one(lp_rows, advantages=[1.0], reference_policy_logprobs=[[-0.5, -1.5]])
    batch["generation_logprobs"] = gen
    cfg = LossConfig(use_importance_sampling_correction=True, reference_policy_kl_penalty=1.0, reference_policy_kl_type="k1")
    loss, m, grad = call(cfg, lp, batch)
    close(m["pg_loss"], -1.25)
    close(m["kl_penalty"], -0.625)
    close(loss, -1.875)
    close(grad, [[-0.5, -0.125]])
    assert gen.grad is None
    lp, batch = one(lp_rows, advantages=[1.0], generation_logprobs=gen.detach())
    _, _, grad = call(LossConfig(use_importance_sampling_correction=True, **PG_ONLY), lp, batch)
    close(grad, [[-1.0, -0.25]])


def test_sequence_level_and_per_token_advantages():
    # r = 1, so pg = -A per token. Per-token A: sample 0 (1, 2, 3) -> mean -2; sample 1 (4, masked, masked) -> -4;
    # sample 2 is sample-masked and not in N_seq = 2.
    # sequence-level: (-2 + -4) / 2 = -3; token-level: (-1 - 2 - 3 - 4) / 4 = -2.5.
    # sequence-level grad = -A / len_i / N_seq: sample 0 -> (-1, -2, -3)/6, sample 1 -> -4/2.
    rows_ = [[-1.0, -1.0, -1.0]] * 3
    cols = dict(advantages=[[1.0, 2.0, 3.0], [4.0, 0.0, 0.0], [5.0, 5.0, 5.0]],
                token_mask=[[1, 1, 1], [1, 0, 0], [1, 1, 1]], sample_mask=[1, 1, 0])
    lp, batch = one(rows_, **cols)
    loss, m, grad = call(LossConfig(token_level_loss=False, **PG_ONLY), lp, batch)
    close(loss, -3.0)
    close(m["pg_loss"], -3.0)
    close(grad, [[-1 / 6, -2 / 6, -3 / 6], [-2.0, 0.0, 0.0], [0.0, 0.0, 0.0]])
    lp, batch = one(rows_, **cols)
    loss, _, _ = call(LossConfig(**PG_ONLY), lp, batch)
    close(loss, -2.5)


def test_loss_carries_dp_size_but_metrics_do_not():
    lp, batch = one([[0.0, -1.0]], advantages=[1.0], token_mask=[[0, 1]])
    counts = GlobalCounts(tokens=1, sequences=1, positive_tokens=0, dp_size=4)
    loss, m, _ = call(LossConfig(**PG_ONLY), lp, batch, counts)
    close(loss, -4.0)  # D * (-A r) / N_tok = 4 * -1 / 1
    close(m["loss"], -1.0)
    assert set(m) == set(METRIC_NAMES)
    assert all(v.dim() == 0 and not v.requires_grad for v in m.values())


def test_masks_accept_bool_and_float():
    lp, batch = one([[0.0, -1.0, -2.0]], advantages=[1.0], token_mask=[[0, 1, 1]])
    ref, _, _ = call(LossConfig(**PG_ONLY), lp, batch)
    for dtype in (torch.bool, torch.float32):
        lp, batch = one([[0.0, -1.0, -2.0]], advantages=[1.0], token_mask=[[0, 1, 1]])
        batch["token_mask"], batch["sample_mask"] = batch["token_mask"].to(dtype), batch["sample_mask"].to(dtype)
        loss, _, _ = call(LossConfig(**PG_ONLY), lp, batch)
        close(loss, ref)


# ---------------------------------------------------------------- refusals and zero counts

def test_refuses_nll_without_rewards():
    lp, batch = one([[-1.0]])
    with pytest.raises(MissingColumnError, match=r"rewards.*total_reward"):
        call(LossConfig(positive_example_nll_weight=0.1, **PG_ONLY), lp, batch)


@pytest.mark.parametrize("cfg,column", [
    (dict(reference_policy_kl_penalty=0.1), "reference_policy_logprobs"),
    (dict(use_importance_sampling_correction=True, **PG_ONLY), "generation_logprobs"),
    (PG_ONLY, "prev_logprobs"),
    (PG_ONLY, "advantages"),
    (PG_ONLY, "token_mask"),
])
def test_refuses_missing_column(cfg, column):
    lp, batch = one([[-1.0, -1.0]], reference_policy_logprobs=[[-1.0, -1.0]], generation_logprobs=[[-1.0, -1.0]])
    counts = local_counts(batch)
    del batch[column]
    with pytest.raises(MissingColumnError, match=column):
        ClippedPGLoss(LossConfig(**cfg))(lp, batch, counts)


@pytest.mark.parametrize("column,bad,want", [
    ("prev_logprobs", torch.zeros(2, 4), r"prev_logprobs has shape \[2, 4\] but must be .*\[2, 3\]"),
    ("reference_policy_logprobs", torch.zeros(3, 3), r"reference_policy_logprobs has shape \[3, 3\] .*\[2, 3\]"),
    ("generation_logprobs", torch.zeros(2), r"generation_logprobs has shape \[2\] .*\[2, 3\]"),
    ("advantages", torch.zeros(3), r"advantages has shape \[3\] .*\[2\]"),
    ("sample_mask", torch.ones(2, 3), r"sample_mask has shape \[2, 3\] .*\[2\]"),
    ("rewards", torch.ones(3), r"rewards has shape \[3\] .*\[2\]"),
    ("curr", torch.zeros(2, 4), r"curr_logprobs has shape \[2, 4\] .*\[2, 3\]"),
])
def test_refuses_mismatched_shapes(column, bad, want):
    lp, batch = one([[-1.0] * 3] * 2, reference_policy_logprobs=[[-1.0] * 3] * 2,
                    generation_logprobs=[[-1.0] * 3] * 2, rewards=[1.0, 1.0])
    counts = GlobalCounts(4, 2, 4)
    if column == "curr":
        lp = bad
    else:
        batch[column] = bad
    cfg = LossConfig(use_importance_sampling_correction=True, positive_example_nll_weight=0.1)
    with pytest.raises(SchemaError, match=want):
        ClippedPGLoss(cfg)(lp, batch, counts)


def test_zero_valid_tokens_gives_zero_and_finite_grad():
    # Everything masked; masked slots hold -inf / NaN, which must not leak through 0 * inf.
    lp = torch.tensor([[-math.inf, -1.0], [0.0, -2.0]], dtype=torch.float64, requires_grad=True)
    nan = float("nan")
    batch = {"token_mask": torch.tensor([[0, 1], [0, 0]]), "sample_mask": torch.tensor([0, 1]),
             "prev_logprobs": torch.tensor([[nan, nan], [nan, nan]]), "advantages": torch.tensor([1.0, nan]),
             "reference_policy_logprobs": torch.full((2, 2), nan), "generation_logprobs": torch.full((2, 2), nan),
             "rewards": torch.tensor([1.0, 1.0])}
    counts = local_counts(batch)
    assert counts == GlobalCounts(0, 1, 0, 1)
    cfg = LossConfig(ratio_clip_c=3.0, use_importance_sampling_correction=True, positive_example_nll_weight=0.5)
    for token_level in (True, False):
        lp.grad = None
        loss, m, grad = call(cfg.model_copy(update={"token_level_loss": token_level}), lp, batch, counts)
        assert loss.item() == 0.0
        assert all(v.item() == 0.0 for v in m.values())
        assert torch.equal(grad, torch.zeros_like(lp))


def test_no_positive_tokens_gives_zero_nll_and_finite_grad():
    lp, batch = one([[-1.0, -2.0]], advantages=[1.0], rewards=[0.0])
    loss, m, grad = call(LossConfig(positive_example_nll_weight=1.0, **PG_ONLY), lp, batch)
    assert m["positive_nll_loss"].item() == 0.0
    close(loss, -1.0)  # PG only: -A r averaged over 2 tokens
    assert torch.isfinite(grad).all()


# ---------------------------------------------------------------- plain loop twin

def loop_loss(cfg: LossConfig, lp: torch.Tensor, batch: dict, counts: GlobalCounts, threshold=None):
    """The loss of docs/loss.md one token at a time, with 0-dim tensor ops so autograd still works."""
    beta, mu, c = cfg.reference_policy_kl_penalty, cfg.positive_example_nll_weight, cfg.ratio_clip_c
    lo, hi = 1 - cfg.ratio_clip_min, 1 + cfg.ratio_clip_max
    kind, w_hi, w_lo = (cfg.truncated_importance_sampling_type, cfg.truncated_importance_sampling_ratio,
                        cfg.truncated_importance_sampling_ratio_min)
    sums = dict(pg=0.0, kl=0.0, nll=0.0, clip=0, clip_lo=0, clip_hi=0, dual=0, ratio=0.0, ent=0.0, ppo_kl=0.0, n=0,
                w=0.0, w2=0.0, oob=0, seq_masked=0, err=0.0, err_max=0.0, err_masked=0)
    B, T = lp.shape
    for i in range(B):
        if not batch["sample_mask"][i]:
            continue
        toks = [t for t in range(T) if batch["token_mask"][i, t]]
        log_rho = [float(batch["prev_logprobs"][i, t] - batch["generation_logprobs"][i, t]) for t in toks] \
            if "generation_logprobs" in batch else []
        # NeMo-RL's sequence error: mean of exp|gen - prev| over the tokens (0 without tokens or gen log-probs)
        err = sum(math.exp(abs(x)) for x in log_rho) / len(log_rho) if log_rho else 0.0
        sums["err"], sums["err_max"] = sums["err"] + err, max(sums["err_max"], err)
        if threshold is not None and err > threshold:
            sums["err_masked"] += 1
            continue
        geo = math.exp(sum(log_rho) / len(log_rho)) if log_rho else 1.0
        seq_out = kind == "seq-mask-tis" and bool(toks) and not (w_lo <= geo <= w_hi)
        sums["seq_masked"] += int(seq_out)
        seq_pg, seq_kl, seq_n = 0.0, 0.0, 0
        for t in range(T):
            if not batch["token_mask"][i, t]:
                continue
            adv = batch["advantages"]
            a = float(adv[i] if adv.dim() == 1 else adv[i, t])
            r = torch.exp(lp[i, t] - batch["prev_logprobs"][i, t])
            unclipped, clipped = -a * r, -a * torch.clamp(r, lo, hi)
            pg = torch.maximum(unclipped, clipped)
            sums["clip"] += int(clipped > unclipped)
            sums["clip_lo"] += int(clipped > unclipped and r < 1)  # the ratio fell under 1 - eps_low
            sums["clip_hi"] += int(clipped > unclipped and r > 1)  # and over 1 + eps_high
            if c is not None and a < 0 and pg > -c * a:
                pg, sums["dual"] = torch.tensor(-c * a, dtype=lp.dtype), sums["dual"] + 1
            kl = 0.0
            if beta > 0:
                d = torch.clamp(batch["reference_policy_logprobs"][i, t] - lp[i, t], -cfg.kl_input_clamp_value, cfg.kl_input_clamp_value)
                kl = {"k1": -d, "k2": d * d / 2, "k3": torch.exp(d) - 1 - d}[cfg.reference_policy_kl_type]
                kl = torch.clamp(kl, -cfg.kl_output_clamp_value, cfg.kl_output_clamp_value)
                raw = batch["reference_policy_logprobs"][i, t] - lp[i, t]
                if cfg.reference_policy_kl_type != "k2" and abs(raw.item()) <= cfg.kl_input_clamp_value:
                    kl = kl * torch.exp(lp[i, t] - lp[i, t].detach())  # the score term (see kl_estimate)
            w = math.exp(batch["prev_logprobs"][i, t] - batch["generation_logprobs"][i, t]) if cfg.use_importance_sampling_correction else 1.0
            out = (kind == "tis" and w > w_hi) or (kind == "icepop" and not (w_lo <= w <= w_hi)) or seq_out
            w = (min(w, w_hi) if kind == "tis" else 0.0) if out else w
            sums["w"], sums["w2"], sums["oob"] = sums["w"] + w, sums["w2"] + w * w, sums["oob"] + int(out)
            seq_pg, seq_kl, seq_n = seq_pg + w * pg, seq_kl + w * kl, seq_n + 1
            if "rewards" in batch and batch["rewards"][i] > 0:
                sums["nll"] = sums["nll"] - lp[i, t]
            sums["ratio"] += r.item()
            sums["ent"] -= lp[i, t].item()
            sums["ppo_kl"] += (batch["prev_logprobs"][i, t] - lp[i, t]).item()  # k1 of KL(old || new)
            sums["n"] += 1
        if cfg.token_level_loss:
            sums["pg"], sums["kl"] = sums["pg"] + seq_pg, sums["kl"] + seq_kl
        elif seq_n:
            sums["pg"], sums["kl"] = sums["pg"] + seq_pg / seq_n, sums["kl"] + seq_kl / seq_n
    n_tok, n_pg = max(counts.tokens, 1), max(counts.tokens if cfg.token_level_loss else counts.sequences, 1)
    pg, kl, nll = sums["pg"] / n_pg, sums["kl"] / n_pg, sums["nll"] / max(counts.positive_tokens, 1)
    loss = pg + beta * kl + mu * nll
    metrics = dict(loss=loss, pg_loss=pg, kl_penalty=kl, positive_nll_loss=nll, clip_fraction=sums["clip"] / n_tok,
                   dual_clip_fraction=sums["dual"] / n_tok, probs_ratio_mean=sums["ratio"] / n_tok,
                   approx_entropy=sums["ent"] / n_tok, num_valid_tokens=sums["n"],
                   clip_fraction_lower=sums["clip_lo"] / n_tok, clip_fraction_upper=sums["clip_hi"] / n_tok,
                   ppo_kl=sums["ppo_kl"] / n_tok, sampling_importance_ratio=sums["w"] / n_tok,
                   is_weight_sq_mean=sums["w2"] / n_tok, is_oob_ratio=sums["oob"] / n_tok, is_masked_seqs=sums["seq_masked"],
                   mean_seq_mult_prob_error=sums["err"] / max(counts.sequences + counts.masked_sequences, 1),
                   max_seq_mult_prob_error=sums["err_max"], num_masked_seqs=sums["err_masked"])
    return loss, {k: float(v.detach() if torch.is_tensor(v) else v) for k, v in metrics.items()}


CONFIGS = {
    "default": LossConfig(),
    "everything": LossConfig(ratio_clip_min=0.1, ratio_clip_max=0.15, ratio_clip_c=2.0, reference_policy_kl_penalty=0.2,
                             positive_example_nll_weight=0.3, use_importance_sampling_correction=True),
    "sequence_k1": LossConfig(token_level_loss=False, reference_policy_kl_type="k1", reference_policy_kl_penalty=0.1,
                              positive_example_nll_weight=0.5, ratio_clip_c=3.0),
    "k2_tight_clamps": LossConfig(reference_policy_kl_type="k2", reference_policy_kl_penalty=1.0,
                                  kl_input_clamp_value=0.3, kl_output_clamp_value=0.02),
}


def check_loop_matches(cfg: LossConfig, batch: dict, lp_values: torch.Tensor):
    counts = local_counts(batch)
    lp_vec = lp_values.clone().requires_grad_(True)
    loss, metrics = ClippedPGLoss(cfg)(lp_vec, batch, counts)
    loss.backward()
    lp_loop = lp_values.clone().requires_grad_(True)
    ref_loss, ref_metrics = loop_loss(cfg, lp_loop, batch, counts)
    if torch.is_tensor(ref_loss) and ref_loss.requires_grad:
        ref_loss.backward()
    close(loss, ref_metrics["loss"])
    for k in METRIC_NAMES:
        close(metrics[k], ref_metrics[k])
    close(lp_vec.grad, lp_loop.grad if lp_loop.grad is not None else torch.zeros_like(lp_values))


@pytest.mark.parametrize("name", sorted(CONFIGS))
@pytest.mark.parametrize("seed", [0, 1])
def test_loop_matches_vectorised(name, seed):
    policy = TinyPolicy()
    batch = make_batch(policy, B=16, T=9, seed=seed)
    with torch.no_grad():
        lp = policy(batch["input_ids"])  # [B, T]
    check_loop_matches(CONFIGS[name], batch, lp)


@settings(max_examples=25, deadline=None)
@given(seed=st.integers(0, 2**31 - 1), B=st.integers(1, 6), T=st.integers(2, 7), name=st.sampled_from(sorted(CONFIGS)),
       per_token_adv=st.booleans(), dead=st.integers(0, 2))
def test_loop_matches_vectorised_random_shapes(seed, B, T, name, per_token_adv, dead):
    policy = TinyPolicy()
    batch = make_batch(policy, B=B, T=T, seed=seed, dead=dead)
    if per_token_adv:
        batch["advantages"] = torch.randn(B, T, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)
    with torch.no_grad():
        lp = policy(batch["input_ids"])  # [B, T]
    check_loop_matches(CONFIGS[name], batch, lp)


# ---------------------------------------------------------------- microbatch and rank invariance

@pytest.fixture(scope="module")
def full_batch_results():
    """The single-rank, single-microbatch reference per (config, positive)."""
    cache = {}

    def get(name, positive):
        if (name, positive) not in cache:
            torch.manual_seed(0)
            policy = TinyPolicy()
            batch = make_batch(policy, seed=3, positive=positive)
            cache[name, positive] = (policy, batch, run_sharded(policy, batch, CONFIGS[name], 1, 1))
        return cache[name, positive]
    return get


@pytest.mark.parametrize("n_ranks", [1, 2, 4])
@pytest.mark.parametrize("n_micro", [1, 2, 7, 32])
@pytest.mark.parametrize("name,positive", [("everything", True), ("everything", False), ("sequence_k1", True)])
def test_microbatch_and_rank_invariance(full_batch_results, name, positive, n_ranks, n_micro):
    policy, batch, (ref_loss, ref_metrics, ref_grads) = full_batch_results(name, positive)
    assert ref_metrics["clip_fraction"] > 0
    if name == "everything":  # c = 2 is hit by this seed; c = 3 in sequence_k1 may not be
        assert ref_metrics["dual_clip_fraction"] > 0
    assert (ref_metrics["positive_nll_loss"] > 0) == positive
    assert_same_step(run_sharded(policy, batch, CONFIGS[name], n_ranks, n_micro), (ref_loss, ref_metrics, ref_grads))


def assert_same_step(got, want) -> None:
    """Two `run_sharded` results (loss, metrics, gradients) agree."""
    (loss, metrics, grads), (ref_loss, ref_metrics, ref_grads) = got, want
    close(loss, ref_loss)
    assert metrics.keys() == ref_metrics.keys()
    for k in ref_metrics:
        close(metrics[k], ref_metrics[k])
    for g, ref in zip(grads, ref_grads):
        close(g, ref)


def test_positive_nll_not_scaled_by_microbatch_count():
    # The 32x regression: per-microbatch NLL normalisation made the term 32x too large with 32 microbatches.
    cfg = LossConfig(positive_example_nll_weight=1.0, reference_policy_kl_penalty=0.0)
    torch.manual_seed(0)
    policy = TinyPolicy()
    batch = make_batch(policy, seed=5)
    _, one_mb, one_grads = run_sharded(policy, batch, cfg, 1, 1)
    _, many_mb, many_grads = run_sharded(policy, batch, cfg, 1, 32)
    assert one_mb["positive_nll_loss"] > 0
    close(many_mb["positive_nll_loss"], one_mb["positive_nll_loss"])
    for g, ref in zip(many_grads, one_grads):
        close(g, ref)


def test_counts_helpers_without_process_group():
    policy = TinyPolicy()
    batch = make_batch(policy, B=10, seed=1)
    whole = local_counts(batch)
    split = local_counts([rows(batch, i) for i in torch.tensor_split(torch.arange(10), 3)])
    assert whole == split
    assert whole.tokens == int(((batch["token_mask"] != 0) & (batch["sample_mask"] != 0)[:, None]).sum())
    assert all_reduce_counts(whole) == whole  # no process group: one rank
    with pytest.raises(ValueError, match="already reduced"):
        all_reduce_counts(GlobalCounts(1, 1, 1, dp_size=2))
    no_rewards = {k: v for k, v in batch.items() if k != "rewards"}
    assert local_counts(no_rewards).positive_tokens == 0


def test_reduce_metrics_sums_and_checks_names():
    total = reduce_metrics([{"a": torch.tensor(0.25), "b": 1.0}, {"a": torch.tensor(0.5), "b": 2.0}])
    assert total == {"a": 0.75, "b": 3.0}
    with pytest.raises(ValueError, match="microbatch 1"):
        reduce_metrics([{"a": 1.0}, {"b": 1.0}])
