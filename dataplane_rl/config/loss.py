"""`loss_fn.*`: the clipped policy-gradient loss's config (the loss itself: algorithms/loss.py)."""

from __future__ import annotations

from typing import Literal, Optional

from pydantic import ConfigDict, Field, model_validator

from dataplane_rl.config_types import StrictScalars


class LossConfig(StrictScalars):
    """`loss_fn.*`: the clipped policy-gradient loss, its KL penalty and the positive-example NLL."""

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)

    ratio_clip_min: float = Field(0.2, ge=0.0, lt=1.0, description="eps_low: the ratio is clipped below at 1 - eps_low.")
    ratio_clip_max: float = Field(0.2, ge=0.0, description="eps_high: the ratio is clipped above at 1 + eps_high; raise it (e.g. 0.28) for clip-higher.")
    ratio_clip_c: Optional[float] = Field(None, gt=1.0, description="Dual-clip constant c (> 1): for A < 0 the per-token loss is capped at -c*A. None disables it.")
    reference_policy_kl_penalty: float = Field(0.01, ge=0.0, description="beta: weight of the KL penalty to the reference policy; 0 turns it off and skips the reference pass.")
    reference_policy_kl_type: Literal["k1", "k2", "k3"] = Field("k3", description="KL estimator: k1 = -d, k2 = d^2/2, k3 = e^d - 1 - d with d = lp_ref - lp.")
    kl_input_clamp_value: float = Field(20.0, gt=0.0, description="d = lp_ref - lp is clamped to +-this before the KL estimator.")
    kl_output_clamp_value: float = Field(10.0, gt=0.0, description="The per-token KL estimate is clamped to +-this.")
    token_level_loss: bool = Field(True, description="True: mean over all valid tokens of the global batch; False: per-sequence token means averaged over sequences.")
    positive_example_nll_weight: float = Field(0.0, ge=0.0, description="mu: weight of the VAPO NLL on tokens of samples with reward > 0; needs the rewards column in the train fields.")
    use_importance_sampling_correction: bool = Field(False, description="Multiply the per-token PG and KL terms by the detached weight exp(prev - generation log-prob).")
    truncated_importance_sampling_type: Optional[Literal["tis", "icepop", "seq-mask-tis"]] = Field(None, description="Bound the importance weight rho: tis = min(rho, ratio); icepop = rho inside [ratio_min, ratio], else 0; seq-mask-tis = rho on sequences whose geometric-mean rho lies in [ratio_min, ratio], else 0. null: rho unbounded. Needs use_importance_sampling_correction=true.")
    truncated_importance_sampling_ratio: Optional[float] = Field(None, gt=0.0, description="Upper bound of the importance weight, required with a type (peers start at 2 for tis, 5 for icepop, 1.01 for seq-mask-tis; docs/loss.md).")
    truncated_importance_sampling_ratio_min: Optional[float] = Field(None, gt=0.0, description="Lower bound of the importance weight; required by icepop (peers: 0.5) and seq-mask-tis (peers: 0.99), unused by tis.")

    @model_validator(mode="after")
    def _bounds(self) -> "LossConfig":
        kind, hi, lo = (self.truncated_importance_sampling_type, self.truncated_importance_sampling_ratio,
                        self.truncated_importance_sampling_ratio_min)
        key = "loss_fn.truncated_importance_sampling_"
        if kind is None:
            if hi is not None or lo is not None:
                raise ValueError(f"{key}ratio / {key}ratio_min are set but {key}type is null, so they bound nothing; "
                                 f"set {key}type (tis, icepop or seq-mask-tis) or drop them")
            return self
        if not self.use_importance_sampling_correction:
            raise ValueError(f"{key}type={kind} bounds the importance weight, which needs "
                             "loss_fn.use_importance_sampling_correction=true; set it, or set the type to null")
        if hi is None:
            raise ValueError(f"{key}type={kind} needs an upper bound {key}ratio (e.g. 2.0 for tis)")
        if kind == "tis" and lo is not None:
            raise ValueError(f"{key}ratio_min={lo} is unused by {key}type=tis (it truncates above only); drop it, "
                             "or use icepop or seq-mask-tis")
        if kind != "tis":
            if lo is None:
                raise ValueError(f"{key}type={kind} needs a lower bound {key}ratio_min (e.g. 0.5 for icepop, 0.99 "
                                 "for seq-mask-tis)")
            if lo > hi:
                raise ValueError(f"{key}ratio_min={lo} is above {key}ratio={hi}: the bounds are inverted; "
                                 "ratio_min must be <= ratio")
        return self
