"""Bounded off-policy correction: truncated or masked importance weights and sequence masking by mismatch (docs/loss.md)."""

from __future__ import annotations

from typing import Optional

import torch

TIS_TYPES = ("tis", "icepop", "seq-mask-tis")


def seq_mult_prob_error(lp_old: torch.Tensor, lp_gen: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """NeMo-RL's per-sequence multiplicative probability error [B]: the mean over the sequence's valid tokens of
    exp|generation - prev log-prob| (>= 1); 0 for a sequence without a valid token, as NeMo-RL (never masked).

    Entries off `valid` (prompt, padding, observation tokens) are selected away before exp, never multiplied:
    they may hold NaN or a prompt log-prob against 0.0.
    """
    gap = torch.where(valid, (lp_gen.double() - lp_old.double()).abs(), 0.0)  # [B, T]
    n = valid.sum(dim=1)  # [B]
    total = torch.where(valid, gap.exp(), 0.0).sum(dim=1)  # [B]
    return total / n.clamp(min=1)  # [B]


def seq_error_keep(batch, sample: torch.Tensor, valid: torch.Tensor, threshold: Optional[float]):
    """(keep [B] bool, error [B] float64): the sequences `grpo.seq_logprob_error_threshold` keeps, and their error.

    A sequence whose error passes the threshold leaves the loss (and every normaliser); `sample_mask` itself is
    never rewritten. Without `generation_logprobs` in the batch the error is 0 (unmeasured) and nothing is masked.
    """
    gen, prev = batch.get("generation_logprobs"), batch.get("prev_logprobs")
    if gen is None or prev is None:
        if threshold is not None:
            from dataplane_rl.errors import MissingColumnError

            raise MissingColumnError(f"grpo.seq_logprob_error_threshold={threshold} needs 'generation_logprobs' and "
                                     f"'prev_logprobs' in the loss batch; it has {sorted(batch)}")
        return sample, torch.zeros(sample.shape[0], dtype=torch.float64, device=sample.device)
    for name, t in (("prev_logprobs", prev), ("generation_logprobs", gen)):
        if list(t.shape) != list(valid.shape):
            from dataplane_rl.errors import SchemaError

            raise SchemaError(f"{name} has shape {list(t.shape)} but must be [B, T] as token_mask = {list(valid.shape)}")
    error = seq_mult_prob_error(prev, gen, valid)  # [B]
    if threshold is None:
        return sample, error
    return sample & (error <= threshold), error


def bounded_weight(log_rho: torch.Tensor, valid: torch.Tensor, kind: str, hi: float, lo: Optional[float]):
    """(w [B, T], out_of_bounds [B, T] bool, seq_masked [B] bool) of `loss_fn.truncated_importance_sampling_type`.

    `log_rho` = prev - generation log-prob, detached, 0 off `valid`. With rho = exp(log_rho):
    - tis: w = min(rho, hi); out of bounds where rho > hi (truncated);
    - icepop: w = rho where lo <= rho <= hi, else 0 (masked);
    - seq-mask-tis: w = rho on sequences whose geometric-mean ratio exp(mean of log_rho over the sequence's valid
      tokens) lies in [lo, hi], 0 on every token of the others.
    w is 0 off `valid`; seq_masked marks the sequences seq-mask-tis zeroes (with at least one valid token).
    """
    rho = torch.where(valid, log_rho.exp(), 0.0)  # [B, T]
    no_seq = torch.zeros(valid.shape[0], dtype=torch.bool, device=valid.device)  # [B]
    if kind == "tis":
        oob = valid & (rho > hi)  # [B, T]
        return torch.where(oob, torch.full_like(rho, hi), rho), oob, no_seq
    if kind == "icepop":
        oob = valid & ((rho < lo) | (rho > hi))  # [B, T]
        return torch.where(oob, 0.0, rho), oob, no_seq
    if kind == "seq-mask-tis":
        n = valid.sum(dim=1)  # [B]
        geo = torch.exp(torch.where(valid, log_rho, 0.0).sum(dim=1) / n.clamp(min=1))  # [B]
        seq_masked = (n > 0) & ((geo < lo) | (geo > hi))  # [B]
        oob = valid & seq_masked[:, None]  # [B, T]
        return torch.where(oob, 0.0, rho), oob, seq_masked
    raise ValueError(f"unknown loss_fn.truncated_importance_sampling_type {kind!r}; use one of {', '.join(TIS_TYPES)}")
