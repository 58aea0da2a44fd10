"""Clipped policy-gradient loss with KL penalty and VAPO positive-example NLL (docs/loss.md).

The loss is a pure function of tensors and explicit global counts: it reads no process group and no
global state. The counts (`N_tok`, `N_seq`, `N_pos`, `D`) are all-reduced once per optimizer step by
`dataplane_rl.train.counts`, next to the training loop.

Scaling, so that the training loop only sums and FSDP2 (like DDP) only averages:
- the returned loss carries a factor `D`: FSDP2's reduce-scatter divides the summed rank gradients by `D`, so the final
  gradient is the gradient of the global-batch loss, whatever the microbatch size or number of ranks;
- every metric is divided by its global count and NOT multiplied by `D`: summing a metric over the
  microbatches of every rank gives the exact global value.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping, NamedTuple, Optional

import torch

from dataplane_rl.algorithms.correction import bounded_weight, seq_error_keep
from dataplane_rl.config.loss import LossConfig
from dataplane_rl.errors import MissingColumnError, SchemaError

METRIC_NAMES: tuple[str, ...] = (
    "loss", "pg_loss", "kl_penalty", "positive_nll_loss", "clip_fraction", "dual_clip_fraction",
    "probs_ratio_mean", "approx_entropy", "num_valid_tokens", "clip_fraction_lower", "clip_fraction_upper", "ppo_kl",
    "sampling_importance_ratio", "is_weight_sq_mean", "is_oob_ratio", "is_masked_seqs",
    "mean_seq_mult_prob_error", "max_seq_mult_prob_error", "num_masked_seqs",
)
# Reduced by max over microbatches and ranks, not summed (each microbatch returns its own max).
MAX_METRICS: frozenset[str] = frozenset({"max_seq_mult_prob_error"})


def finish_metrics(total: dict[str, float]) -> dict[str, float]:
    """Metrics that are ratios of global sums, computed once after the reduction (never per microbatch).

    is_eff_sample_size = (mean w)^2 / mean(w^2) over the valid tokens: Kish's effective sample size of the
    importance weights as a fraction of the tokens (1 when every weight is equal, as verl's rollout_is_eff_sample_size).
    """
    if "sampling_importance_ratio" in total and "is_weight_sq_mean" in total:
        sq = total["is_weight_sq_mean"]
        total["is_eff_sample_size"] = total["sampling_importance_ratio"] ** 2 / sq if sq > 0 else 1.0
    return total


@dataclass(frozen=True)
class GlobalCounts:
    """The loss normalisers of one optimizer step, summed over every microbatch of every rank.

    tokens = N_tok = sum(token_mask * sample_mask); sequences = N_seq = sum(sample_mask);
    positive_tokens = N_pos = sum(token_mask * sample_mask * [rewards > 0]), each over the sequences that
    `grpo.seq_logprob_error_threshold` keeps (`derived_masks`); dp_size = D, the number
    of data-parallel ranks whose gradients DDP averages. Build them with
    `dataplane_rl.train.counts.local_counts` + `all_reduce_counts`.
    """

    tokens: int
    sequences: int
    positive_tokens: int
    dp_size: int = 1
    masked_sequences: int = 0  # samples grpo.seq_logprob_error_threshold took out of N_seq (and their tokens of N_tok)

    def __post_init__(self):
        for name in ("tokens", "sequences", "positive_tokens", "masked_sequences"):
            if getattr(self, name) < 0:
                raise ValueError(f"GlobalCounts.{name}={getattr(self, name)} must be >= 0")
        if self.dp_size < 1:
            raise ValueError(f"GlobalCounts.dp_size={self.dp_size} must be >= 1")


def _shape(t: torch.Tensor) -> list[int]:
    return list(t.shape)


def _require(batch: Mapping[str, torch.Tensor], key: str, why: str) -> torch.Tensor:
    if key not in batch or batch[key] is None:
        raise MissingColumnError(f"loss batch lacks '{key}', which {why}; batch has {sorted(batch)}")
    return batch[key]


def _check_shape(name: str, t: torch.Tensor, want: list[int], what: str) -> None:
    if _shape(t) != want:
        raise SchemaError(f"{name} has shape {_shape(t)} but must be {what} = {want}")


class Masks(NamedTuple):
    """The masks of one batch under `grpo.seq_logprob_error_threshold`, derived once (`derived_masks`) and shared
    by every loss term, the counts and the entropy metric. valid [B, T], sample [B], positive [B, T] or None,
    written [B], error [B] (float64)."""

    valid: torch.Tensor
    sample: torch.Tensor
    positive: Optional[torch.Tensor]
    written: torch.Tensor
    error: torch.Tensor


def derived_masks(batch: Mapping[str, torch.Tensor], seq_logprob_error_threshold: Optional[float] = None) -> Masks:
    """The one derivation of the batch's masks, shapes checked: (valid, sample, positive, written, error).

    written = sample_mask != 0, as the column holds it; error = each sequence's multiplicative probability
    error over its written valid tokens (`correction.seq_mult_prob_error`, 0 without generation_logprobs);
    sample = written & error <= threshold (the column itself is never rewritten); valid = token_mask * sample;
    positive = valid * [rewards > 0], None without `rewards`. Masks may be int8, bool or float: any nonzero
    entry counts as 1.
    """
    token_mask = _require(batch, "token_mask", "marks the trained tokens")
    sample_mask = _require(batch, "sample_mask", "marks the trained samples")
    if token_mask.dim() != 2:
        raise SchemaError(f"token_mask has shape {_shape(token_mask)} but must be [B, T]")
    B = token_mask.shape[0]
    _check_shape("sample_mask", sample_mask, [B], "[B] with B from token_mask")
    written = sample_mask != 0  # [B]
    tokens = token_mask != 0  # [B, T]
    sample, error = seq_error_keep(batch, written, tokens & written[:, None], seq_logprob_error_threshold)  # [B] each
    valid = tokens & sample[:, None]  # [B, T]
    rewards = batch.get("rewards")
    if rewards is None:
        return Masks(valid, sample, None, written, error)
    _check_shape("rewards", rewards, [B], "[B] with B from token_mask")
    return Masks(valid, sample, valid & (rewards > 0)[:, None], written, error)  # positive [B, T]


def kl_estimate(lp: torch.Tensor, lp_ref: torch.Tensor, kind: str, input_clamp: float, output_clamp: float) -> torch.Tensor:
    """Per-token KL(pi || pi_ref) estimate (Schulman's k1/k2/k3), d = lp_ref - lp clamped on both sides.

    The value is the clamped estimate. Its gradient is built so that, for tokens sampled from pi, the
    expected gradient is grad KL(pi || pi_ref) for every kind:
    - k1 and k3 are unbiased for the KL, so grad E_pi[k] = E_pi[grad k + k grad lp]: they are multiplied
      by the score weight s = exp(lp - lp.detach()) (value 1, gradient grad lp). Without it the expected
      gradient of k3 is that of the forward KL, and that of k1 is 0.
    - k2's plain gradient E_pi[(lp - lp_ref) grad lp] already is grad KL; adding s would give the
      gradient of E_pi[k2], which is not the KL, so k2 gets no s.
    s is applied after the output clamp, so a clamped token still carries k_clamped * grad lp: the
    expected gradient is that of E_pi[clamped estimate], the value reported as kl_penalty. Where the
    input clamp is active, s is detached, as in NeMo-RL: d is then a constant, so such a token has no
    gradient at all, and an outlier cannot push the policy through the score term either.
    """
    raw = lp_ref - lp  # [B, T]
    d = raw.clamp(-input_clamp, input_clamp)  # [B, T]
    if kind == "k1":
        kl = -d
    elif kind == "k2":
        kl = 0.5 * d * d
    elif kind == "k3":
        # expm1 keeps k3 accurate when d is tiny (policy close to the reference)
        kl = torch.expm1(d) - d
    else:
        raise ValueError(f"unknown KL type {kind!r}; use k1, k2 or k3")
    kl = kl.clamp(-output_clamp, output_clamp)  # [B, T]
    if kind == "k2":
        return kl
    score = torch.exp(lp - lp.detach())  # [B, T], exactly 1
    score = torch.where(raw.abs() > input_clamp, score.detach(), score)  # [B, T]
    return kl * score  # [B, T]


class ClippedPGLoss:
    """Clipped PG + beta * KL + mu * positive-example NLL over one microbatch, globally normalised.

    `loss, metrics = ClippedPGLoss(cfg)(curr_logprobs, batch, counts)`, the call every loss term takes
    (`topk_logprobs`: the student's log-probs at the teacher's ids, which only DistillationLoss reads; `masks`: the
    batch's `self.masks(batch)` when the caller derived them already):
    - `curr_logprobs` [B, T]: entry t is log p(token t | tokens < t) under the current policy;
      position 0 (no prediction) and padding must be masked out by `token_mask`.
    - `batch`: `prev_logprobs` [B, T], `advantages` [B] or [B, T], `token_mask` [B, T],
      `sample_mask` [B]; `reference_policy_logprobs` [B, T] when beta > 0; `generation_logprobs`
      [B, T] with importance-sampling correction; `rewards` [B] when mu > 0.
    - `counts`: the global `GlobalCounts` of the whole optimizer step.

    Returns the loss (0-dim tensor with grad, carrying the factor `counts.dp_size`) and a dict of
    0-dim detached tensors named in `METRIC_NAMES`. Each metric is this microbatch's share of the
    global value: its sum over all microbatches of all ranks is the global-batch value. `loss` is
    the returned loss divided by `dp_size`; `kl_penalty` and `positive_nll_loss` are unweighted by
    beta and mu, so loss = pg_loss + beta * kl_penalty + mu * positive_nll_loss.
    """

    def __init__(self, cfg: Optional[LossConfig] = None, seq_logprob_error_threshold: Optional[float] = None):
        self.cfg = cfg if cfg is not None else LossConfig()
        # grpo.seq_logprob_error_threshold: pass the same value to train.counts.local_counts
        self.seq_logprob_error_threshold = seq_logprob_error_threshold

    def masks(self, batch: Mapping[str, torch.Tensor]) -> Masks:
        """The batch's masks under this loss's threshold: derive them once per microbatch and pass them on."""
        return derived_masks(batch, self.seq_logprob_error_threshold)

    def __call__(
        self, curr_logprobs: torch.Tensor, batch: Mapping[str, torch.Tensor], counts: GlobalCounts,
        topk_logprobs: Optional[torch.Tensor] = None, *, masks: Optional[Masks] = None,
    ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        cfg = self.cfg
        beta, mu = cfg.reference_policy_kl_penalty, cfg.positive_example_nll_weight
        if not isinstance(counts, GlobalCounts):
            raise TypeError(f"counts must be a GlobalCounts, got {type(counts).__name__}; "
                            "build it with dataplane_rl.train.counts.all_reduce_counts")
        valid, sample, positive, written, seq_error = masks if masks is not None else self.masks(batch)
        B, T = valid.shape
        _check_shape("curr_logprobs", curr_logprobs, [B, T], "[B, T] as token_mask")
        if mu > 0 and positive is None:
            raise MissingColumnError(
                f"loss_fn.positive_example_nll_weight={mu} needs 'rewards' in the loss batch; the train fields "
                "must carry the column aliased to 'rewards' (total_reward), or set the weight to 0")

        def token_input(key: str, why: str) -> torch.Tensor:
            t = _require(batch, key, why)
            _check_shape(key, t, [B, T], "[B, T] as curr_logprobs")
            return t

        # Upcast: the ratio exp(lp - lp_old) of bf16 log-probs is too coarse to clip meaningfully.
        dtype = torch.promote_types(curr_logprobs.dtype, torch.float32)
        zero = curr_logprobs.new_zeros((), dtype=dtype)

        def clean(t: torch.Tensor) -> torch.Tensor:
            # Select, never multiply: masked entries (position 0, padding) may hold -inf or NaN, and
            # 0 * inf would leak NaN into the loss and its gradient.
            return torch.where(valid, t.to(dtype), zero)  # [B, T]

        lp = clean(curr_logprobs)  # [B, T]
        lp_old = clean(token_input("prev_logprobs", "the PPO ratio needs"))  # [B, T]
        adv = _require(batch, "advantages", "the policy gradient needs")
        if adv.dim() == 1:
            _check_shape("advantages", adv, [B], "[B] (or [B, T]) with B from token_mask")
            adv = adv[:, None].expand(B, T)  # [B, T]
        else:
            _check_shape("advantages", adv, [B, T], "[B] or [B, T] as token_mask")
        adv = clean(adv)  # [B, T]
        m = valid.to(dtype)  # [B, T]

        # Clipped surrogate; pessimistic max of unclipped and clipped (both are losses).
        ratio = torch.exp(lp - lp_old)  # [B, T]
        pg_unclipped = -adv * ratio  # [B, T]
        pg_clipped = -adv * ratio.clamp(1.0 - cfg.ratio_clip_min, 1.0 + cfg.ratio_clip_max)  # [B, T]
        pg = torch.maximum(pg_unclipped, pg_clipped)  # [B, T]
        clipped = (pg_clipped > pg_unclipped) & valid  # [B, T]
        if cfg.ratio_clip_c is not None:
            cap = -cfg.ratio_clip_c * adv  # [B, T]
            dual = (adv < 0) & (pg > cap) & valid  # [B, T]
            pg = torch.where(dual, cap, pg)  # [B, T]
        else:
            dual = torch.zeros_like(valid)  # [B, T]

        if beta > 0:
            lp_ref = clean(token_input("reference_policy_logprobs", f"the KL penalty (loss_fn.reference_policy_kl_penalty={beta}) needs"))
            kl = kl_estimate(lp, lp_ref, cfg.reference_policy_kl_type, cfg.kl_input_clamp_value, cfg.kl_output_clamp_value)  # [B, T]
        else:
            kl = torch.zeros_like(lp)  # [B, T]

        if cfg.use_importance_sampling_correction:
            lp_gen = clean(token_input("generation_logprobs", "loss_fn.use_importance_sampling_correction needs"))
            # Detached: w corrects the sampling distribution, it is not a function of the policy.
            if cfg.truncated_importance_sampling_type is None:
                weight = torch.exp(lp_old - lp_gen).detach() * m  # [B, T]
                oob, seq_masked = torch.zeros_like(valid), torch.zeros_like(sample)  # [B, T], [B]
            else:
                weight, oob, seq_masked = bounded_weight(
                    (lp_old - lp_gen).detach(), valid, cfg.truncated_importance_sampling_type,
                    cfg.truncated_importance_sampling_ratio, cfg.truncated_importance_sampling_ratio_min)  # [B, T], [B, T], [B]
        else:
            weight = m  # [B, T]
            oob, seq_masked = torch.zeros_like(valid), torch.zeros_like(sample)  # [B, T], [B]

        n_tok = max(counts.tokens, 1)
        if cfg.token_level_loss:
            pg_term = (weight * pg).sum() / n_tok
            kl_term = (weight * kl).sum() / n_tok
        else:
            # A sequence never straddles microbatches, so its local token count is its full count.
            seq_len = m.sum(dim=1).clamp(min=1.0)  # [B]
            n_seq = max(counts.sequences, 1)
            pg_term = ((weight * pg).sum(dim=1) / seq_len).sum() / n_seq
            kl_term = ((weight * kl).sum(dim=1) / seq_len).sum() / n_seq

        if positive is not None:
            nll_term = torch.where(positive, -lp, zero).sum() / max(counts.positive_tokens, 1)
        else:
            nll_term = zero
        global_loss = pg_term + beta * kl_term + mu * nll_term
        # DDP averages gradients over D ranks; the factor D turns that average into the global sum.
        loss = counts.dp_size * global_loss

        with torch.no_grad():
            metrics = {
                "loss": global_loss,
                "pg_loss": pg_term,
                "kl_penalty": kl_term,
                "positive_nll_loss": nll_term,
                "clip_fraction": clipped.sum().to(dtype) / n_tok,
                # the sides of the clip: ratio below 1 - eps_low (A < 0) and above 1 + eps_high (A > 0)
                "clip_fraction_lower": (clipped & (ratio < 1.0)).sum().to(dtype) / n_tok,
                "clip_fraction_upper": (clipped & (ratio > 1.0)).sum().to(dtype) / n_tok,
                # verl's ppo_kl: the k1 estimate of KL(old || new) over the valid tokens
                "ppo_kl": ((lp_old - lp) * m).sum() / n_tok,
                "dual_clip_fraction": dual.sum().to(dtype) / n_tok,
                "probs_ratio_mean": (ratio * m).sum() / n_tok,
                "approx_entropy": (-lp * m).sum() / n_tok,
                "num_valid_tokens": m.sum(),
                # the importance weights over the valid tokens: mean, mean square (for the effective sample size,
                # `finish_metrics`), share truncated or masked; sequences seq-mask-tis zeroed (a count)
                # float64 sums: the ESS (mean w)^2 / mean(w^2) <= 1 must not pass 1 by float32 summation order
                "sampling_importance_ratio": weight.double().sum() / n_tok,
                "is_weight_sq_mean": weight.double().square().sum() / n_tok,
                "is_oob_ratio": oob.sum().to(dtype) / n_tok,
                "is_masked_seqs": seq_masked.sum().to(dtype),
                # per-sequence multiplicative probability error of the written samples, before the threshold mask
                "mean_seq_mult_prob_error": torch.where(written, seq_error, 0.0).sum().to(dtype)
                / max(counts.sequences + counts.masked_sequences, 1),
                "max_seq_mult_prob_error": torch.where(written, seq_error, 0.0).max().to(dtype) if B else zero,
                "num_masked_seqs": (written & ~sample).sum().to(dtype),
            }
        return loss, {k: v.detach() for k, v in metrics.items()}
