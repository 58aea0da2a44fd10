"""`grpo.replay.*`: the group replay buffer (driver/replay.py); its own model, held by GRPOConfig as `replay`."""

from __future__ import annotations

from typing import Literal, Optional

from pydantic import Field, model_validator

from dataplane_rl.config_types import CONFIG, StrictScalars


class ReplayConfig(StrictScalars):
    """`grpo.replay.*`: whole groups trained again from the store, by reference (docs/grpo.md#group-replay). Off:
    every step trains only the groups it generated, as without the section."""

    model_config = CONFIG

    enabled: bool = Field(False, description="Keep each step's informative groups (rewards not all equal) as references to their rows in the store, and fill part of each later step from them; the partitions an entry refers to outlive their step until its last entry goes. Needs the synchronous loop (grpo.async_grpo.enabled=false).")
    capacity_groups: int = Field(64, ge=1, description="Most groups the buffer holds; past it the oldest admitted go first (replay/evicted_groups/capacity). Bounds the partitions kept alive.")
    strategy: Literal["fifo", "uniform", "priority", "recency"] = Field("priority", description="Which eligible groups a step replays: fifo the oldest admitted first, recency the newest first, uniform at random, priority at random weighted by the group's mean absolute advantage (the groups that still teach most); the draws come from grpo.seed and are in the checkpoint.")
    max_reuse: int = Field(2, ge=1, description="Times a group may be replayed after the step that generated it trained it; then it is evicted (replay/evicted_groups/reuse).")
    max_staleness: int = Field(2, ge=0, description="Most policy versions between the weights that generated a group and those that train it on replay (verl's max_off_policy_threshold, drop mode); older groups are evicted (replay/evicted_groups/staleness). 0: a group is only ever trained by the step that made it, so nothing is replayed.")
    easy_threshold: Optional[float] = Field(None, description="Difficulty pools (prime-rl's names): a group whose mean reward is at least this is easy. null: no easy pool.")
    hard_threshold: Optional[float] = Field(None, description="A group whose mean reward is at most this is hard. null: no hard pool.")
    easy_fraction: float = Field(0.0, ge=0.0, le=1.0, description="Share of a step's replayed groups drawn from the easy pool (rounded; a pool short of groups leaves its places to the others, drawn from every eligible group).")
    hard_fraction: float = Field(0.0, ge=0.0, le=1.0, description="Share of a step's replayed groups drawn from the hard pool; the rest come from the groups between the thresholds.")
    fresh_fraction: float = Field(0.5, gt=0.0, le=1.0, description="Share of each step's grpo.num_prompts_per_step groups generated fresh (rounded up); the rest come from the buffer when it has eligible groups, else are generated too. With grpo.use_dynamic_sampling, groups a round left out for equal rewards are also taken from the buffer before another round is generated.")

    @model_validator(mode="after")
    def _pools(self) -> "ReplayConfig":
        if self.easy_fraction + self.hard_fraction > 1:
            raise ValueError(f"grpo.replay.easy_fraction={self.easy_fraction} + hard_fraction={self.hard_fraction} is "
                             "more than all of a step's replayed groups; lower one of them")
        for pool, fraction, threshold in (("easy", self.easy_fraction, self.easy_threshold),
                                          ("hard", self.hard_fraction, self.hard_threshold)):
            if fraction > 0 and threshold is None:
                raise ValueError(f"grpo.replay.{pool}_fraction={fraction} draws from a pool grpo.replay.{pool}_threshold "
                                 f"does not define (null); set the threshold, or the fraction to 0")
        if self.easy_threshold is not None and self.hard_threshold is not None and self.hard_threshold >= self.easy_threshold:
            raise ValueError(f"grpo.replay.hard_threshold={self.hard_threshold} is not below easy_threshold="
                             f"{self.easy_threshold}: a group would be easy and hard at once")
        return self
