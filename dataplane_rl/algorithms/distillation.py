"""The on-policy distillation loss: a KL to the teacher's top-k, globally normalised, beside the GRPO loss (docs/distillation.md).

Like loss.py, a pure function of tensors and explicit global counts. The teacher's top-k log-probs
`teacher_topk_logprobs` [B, T, k] (full-vocabulary log-probs of its k most likely next tokens, position t
predicting token t) and the student's log-probs at the same ids [B, T, k] are both renormalised over the k
ids, as NeMo-RL's DistillationLossFn does with `zero_outside_topk: false` (its default):

    p_j = softmax_j(teacher_topk_logprobs),  q_j = softmax_j(student_topk_logprobs)      (j = 1..k)
    forward KL(p || q) = sum_j p_j (log p_j - log q_j)
    reverse KL(q || p) = sum_j q_j (log q_j - log p_j)
    mixed              = w * forward + (1 - w) * reverse                   (w = mixed_kl_weight)

and the loss is sum over valid tokens (token_mask * sample_mask) of the per-token KL / N_tok, so its sum
over microbatches and ranks is the global-batch value whatever the split (the same scaling as loss.py).
"""

from __future__ import annotations

from typing import Mapping, Optional

import torch

from dataplane_rl.algorithms.loss import ClippedPGLoss, GlobalCounts, LossConfig, Masks, _check_shape, _require
from dataplane_rl.errors import MissingColumnError

DISTILL_METRIC_NAMES: tuple[str, ...] = ("distillation_loss", "distillation_student_topk_mass",
                                         "distillation_teacher_topk_mass")


def topk_kl(student_topk_logprobs: torch.Tensor, teacher_topk_logprobs: torch.Tensor, kl_type: str,
            mixed_kl_weight: float = 0.5) -> torch.Tensor:
    """Per-position KL over the last dimension (the k ids), both sides renormalised there: [..., k] -> [...]."""
    ls = torch.log_softmax(student_topk_logprobs, dim=-1)  # [..., k]
    lt = torch.log_softmax(teacher_topk_logprobs, dim=-1)  # [..., k]
    forward = (lt.exp() * (lt - ls)).sum(-1)  # [...]
    reverse = (ls.exp() * (ls - lt)).sum(-1)  # [...]
    if kl_type == "forward":
        return forward
    if kl_type == "reverse":
        return reverse
    if kl_type == "mixed":
        return mixed_kl_weight * forward + (1.0 - mixed_kl_weight) * reverse
    raise ValueError(f"unknown distillation.kl_type {kl_type!r}; use forward, reverse or mixed")


def distillation_loss(student_topk_logprobs: torch.Tensor, teacher_topk_logprobs: torch.Tensor, valid: torch.Tensor,
                      n_tok: int, kl_type: str, mixed_kl_weight: float = 0.5) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """(sum of the per-token top-k KL over `valid` [B, T] / n_tok, metrics as shares of their global values).

    student_topk_logprobs, teacher_topk_logprobs: [B, T, k]. Entries off `valid` (position 0, prompts,
    padding) may hold anything, NaN included: they are selected away before any arithmetic.
    """
    if student_topk_logprobs.shape != teacher_topk_logprobs.shape or student_topk_logprobs.dim() != 3:
        raise ValueError(f"student top-k log-probs {list(student_topk_logprobs.shape)} and teacher top-k log-probs "
                         f"{list(teacher_topk_logprobs.shape)} must both be [B, T, k]")
    _check_shape("valid", valid, list(student_topk_logprobs.shape[:2]), "[B, T] as the top-k log-probs")
    dtype = torch.promote_types(student_topk_logprobs.dtype, torch.float32)
    keep = valid[..., None]  # [B, T, 1]
    ls = torch.where(keep, student_topk_logprobs.to(dtype), 0.0)  # [B, T, k]
    lt = torch.where(keep, teacher_topk_logprobs.to(dtype), 0.0)  # [B, T, k]
    kl = torch.where(valid, topk_kl(ls, lt, kl_type, mixed_kl_weight), 0.0)  # [B, T]
    n = max(int(n_tok), 1)
    term = kl.sum() / n
    with torch.no_grad():
        metrics = {
            "distillation_loss": term.detach(),
            # how much of each distribution the k ids hold (1 = the renormalisation changes nothing)
            "distillation_student_topk_mass": torch.where(keep, ls.exp(), 0.0).sum() / n,
            "distillation_teacher_topk_mass": torch.where(keep, lt.exp(), 0.0).sum() / n,
        }
    return term, metrics


class DistillationLoss:
    """kl_loss_weight * top-k KL + task_loss_weight * ClippedPGLoss over one microbatch, globally normalised.

    `loss, metrics = DistillationLoss(dcfg, loss_cfg)(curr_logprobs, batch, counts, topk_logprobs)`, ClippedPGLoss's
    call: `batch` is ClippedPGLoss's plus `teacher_topk_logprobs` [B, T, k]; `topk_logprobs` [B, T, k] is the
    student's log-probs at the batch's `teacher_topk_ids`. The loss carries the factor `counts.dp_size`;
    metrics are ClippedPGLoss's (its `loss` renamed `task_loss`, `loss` the total) plus DISTILL_METRIC_NAMES.
    """

    def __init__(self, dcfg, loss_cfg: Optional[LossConfig] = None, seq_logprob_error_threshold: Optional[float] = None):
        self.dcfg = dcfg
        # the threshold's masked sequences leave the KL as they leave the task loss and the counts' N_tok
        self.pg = ClippedPGLoss(loss_cfg, seq_logprob_error_threshold)

    @property
    def seq_logprob_error_threshold(self) -> Optional[float]:
        """The threshold the counts and the train step's masks must use, as for ClippedPGLoss."""
        return self.pg.seq_logprob_error_threshold

    def masks(self, batch: Mapping[str, torch.Tensor]) -> Masks:
        """The batch's masks, as ClippedPGLoss.masks: the KL and the task loss share them."""
        return self.pg.masks(batch)

    def __call__(self, curr_logprobs: torch.Tensor, batch: Mapping[str, torch.Tensor], counts: GlobalCounts,
                 topk_logprobs: Optional[torch.Tensor] = None, *, masks: Optional[Masks] = None,
                 ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        d = self.dcfg
        masks = masks if masks is not None else self.masks(batch)
        task, metrics = self.pg(curr_logprobs, batch, counts, masks=masks)  # task carries dp_size; metrics do not
        valid = masks.valid  # [B, T]
        teacher = _require(batch, "teacher_topk_logprobs", "the distillation KL needs (distillation.enabled)")
        if topk_logprobs is None:
            raise MissingColumnError("DistillationLoss needs topk_logprobs, the student's log-probs at the batch's "
                                     "teacher_topk_ids [B, T, k]; compute them in the train forward (at_ids)")
        student_topk_logprobs = topk_logprobs
        kl, dm = distillation_loss(student_topk_logprobs, teacher, valid, counts.tokens, d.kl_type, d.mixed_kl_weight)
        loss = d.task_loss_weight * task + counts.dp_size * d.kl_loss_weight * kl
        metrics["task_loss"] = metrics["loss"]
        metrics["loss"] = (d.task_loss_weight * metrics["task_loss"] + d.kl_loss_weight * dm["distillation_loss"]).detach()
        return loss, {**metrics, **dm}
