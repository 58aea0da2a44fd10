"""`fault_tolerance.*`: how many failures a run survives (its own model; config.py's Config holds it as `fault_tolerance`)."""

from __future__ import annotations

from pydantic import Field

from dataplane_rl.config_types import CONFIG, StrictScalars


class FaultToleranceConfig(StrictScalars):
    """`fault_tolerance.*`: the budgets of the recoveries in docs/faults.md. A budget that runs out ends the run
    with the error it would have stopped with at the first failure."""

    model_config = CONFIG

    max_generation_failures: int = Field(3, ge=0, description="Rollout actors that may die over the run, sync or async (NeMo-RL's grpo.async_grpo.max_generation_failures, there for its async loop only). Each is replaced on its placement slot with the weights its unfinished jobs were sent with, and those jobs run again: committed rows stay, the missing ones come out bit-identical (each row's seed is its own). One more death ends the run with RolloutActorError; 0: the first one does.")
