"""Where the run's steps stand: one record the run loop owns and hands to the fleet and to each step.

The Fleet (driver/fleet.py) is the run's processes; what the steps have done with them lives here, so that a step
(driver/step.py), the refits and the recoveries (faults/) read and write one record instead of the fleet's
attributes. An in-run resume (faults/restart.py) starts a new fleet with a new record: the old one's refits and
weights belonged to actors that are gone.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass
class Progress:
    version: int = 0  # the weights' version: the last training step done (0: the initial ones)
    in_step: int = 0  # the step under way (0: none yet), for the faults a recovery records
    trained: bool = False  # the step under way has stepped the optimizer: a lost store can no longer be regenerated
    last_step_end: float | None = None  # perf_counter() when the last step ended (throughput/samples_per_s)
    policy_ref: Any = None  # the last refit's weights: a state dict in the object store, or a SharedWeights
    # async: the rollout actors' load_weights calls not yet confirmed, as (slot, actor, future)
    refits: list = field(default_factory=list)
    # the group replay buffer (driver/replay.py) when grpo.replay is on: the run loop's, handed to each new record
    replay: Any = None
