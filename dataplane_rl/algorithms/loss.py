"""Clipped policy-gradient loss with KL penalty and VAPO positive-example NLL (DESIGN §5).

Placeholder module holding LossConfig until the loss lands; see issue 4.
"""

from __future__ import annotations

from typing import Literal, Optional

from pydantic import BaseModel, ConfigDict, Field, model_validator


class LossConfig(BaseModel):
    """`loss_fn.*`: the clipped policy-gradient loss, its KL penalty and the positive-example NLL."""

    model_config = ConfigDict(extra="forbid")

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
