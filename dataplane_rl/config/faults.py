"""`fault_tolerance.*`: how many failures a run survives (its own model; config.py's Config holds it as `fault_tolerance`)."""

from __future__ import annotations

from pydantic import Field

from dataplane_rl.config_types import CONFIG, StrictScalars


class FaultToleranceConfig(StrictScalars):
    """`fault_tolerance.*`: the budgets of the recoveries in docs/faults.md. A budget that runs out ends the run
    with the error it would have stopped with at the first failure."""

    model_config = CONFIG

    max_generation_failures: int = Field(3, ge=0, description="Rollout actors that may die over the run, sync or async (NeMo-RL's grpo.async_grpo.max_generation_failures, there for its async loop only). Each is replaced on its placement slot with the weights its unfinished jobs were sent with, and those jobs run again: committed rows stay, the missing ones come out bit-identical (each row's seed is its own). One more death ends the run with RolloutActorError; 0: the first one does.")
    max_data_retries: int = Field(2, ge=0, description="Times a task's reward function or multi-turn environment call that raised is tried again (the same arguments) before its whole group fails: none of the group's rows is stored or trained (never as an empty or zero-reward row), and the step takes its place from a further generation round. Counted in rollout/data_retries_total/<reason>.")
    max_failed_groups: int = Field(8, ge=0, description="Groups that may fail over the run (a reward or environment call failing on every try); one more stops the run with DataFailureError naming task, step, group and exception. 0: the first failed group does.")
    max_restarts: int = Field(3, ge=0, description="In-run restarts over the run (AReaL's recover.retries): a dead train rank rebuilds the train group (new actors, a new process group) and resumes from the last checkpoint in the same process (checkpointing.enabled needed); a dead holder of the run's own Mooncake store (mooncake://) replaces the store, then runs the step again (sync GRPO, before its optimizer steps) or resumes from the last checkpoint. Counted in faults/train_restarts_total and faults/store_restarts_total. One more failure ends the run with its error (TrainRankError, StoreUnavailableError); 0: the first one does.")
