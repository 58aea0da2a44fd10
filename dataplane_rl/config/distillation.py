"""`distillation.*`: on-policy distillation from a teacher's top-k log-probs (NeMo-RL's keys; Config holds it)."""

from __future__ import annotations

from pathlib import Path
from typing import Literal, Optional

from pydantic import Field, field_validator, model_validator

from dataplane_rl.config_types import CONFIG, StrictScalars


class DistillationConfig(StrictScalars):
    """`distillation.*`: the student samples, a frozen teacher scores the student's tokens (its top-k log-probs
    and ids, written as the columns `teacher_topk_logprobs` and `teacher_topk_ids`), and the loss is the KL
    between the two over the teacher's top-k, normalised by the global token count (docs/distillation.md)."""

    model_config = CONFIG

    enabled: bool = Field(False, description="Train on the KL to the teacher's top-k (NeMo-RL's distillation); the train workers load the teacher and write its columns in the log-prob pass.")
    teacher: Optional[str] = Field(None, description="The teacher: a local Hugging Face folder (e.g. a run's exported policy/, `dataplane-rl export`) whose tokenizer has the student's vocabulary. Required when enabled.")
    topk_logits_k: int = Field(64, ge=1, description="k: the teacher's most likely tokens stored per position (NeMo-RL's default 64; verl 32); at most the vocabulary size; the shape of the teacher columns, which the built-in schema declares as [distillation.topk_logits_k].")
    kl_type: Literal["forward", "reverse", "mixed"] = Field("forward", description="forward: KL(teacher || student); reverse: KL(student || teacher); mixed: mixed_kl_weight * forward + (1 - mixed_kl_weight) * reverse. All over the teacher's top-k, both distributions renormalised there (NeMo-RL's loss_fn.kl_type with zero_outside_topk=false).")
    mixed_kl_weight: float = Field(0.5, ge=0.0, le=1.0, description="kl_type=mixed only: the forward KL's weight (NeMo-RL's loss_fn.mixed_kl_weight).")
    kl_loss_weight: float = Field(1.0, ge=0.0, description="Weight of the distillation KL in the loss: loss = kl_loss_weight * KL + task_loss_weight * GRPO loss.")
    task_loss_weight: float = Field(0.0, ge=0.0, description="Weight of the task reward's GRPO loss (clipped PG + KL penalty + NLL, loss_fn.*) beside the KL (verl's use_task_rewards); 0 trains on the teacher alone, as NeMo-RL's distillation does.")

    @field_validator("teacher")
    @classmethod
    def _absolute(cls, v: Optional[str]) -> Optional[str]:
        # the train workers may run in another working directory: they get the absolute folder
        return None if v is None else str(Path(v).expanduser().resolve())

    @model_validator(mode="after")
    def _needs_teacher(self) -> "DistillationConfig":
        if self.enabled and self.teacher is None:
            raise ValueError("distillation.enabled=true needs distillation.teacher, a local Hugging Face folder "
                             "(e.g. RUN_DIR/policy of a finished run, or the output of `dataplane-rl export`)")
        if self.enabled and self.kl_loss_weight == 0 and self.task_loss_weight == 0:
            raise ValueError("distillation.kl_loss_weight and distillation.task_loss_weight are both 0: nothing "
                             "would be trained; raise one of them")
        return self
