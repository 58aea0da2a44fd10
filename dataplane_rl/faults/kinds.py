"""The kinds of fault a run survives or stops on, and the errors and text every fault handler shares."""

from __future__ import annotations

import enum

from dataplane_rl.errors import DataPlaneError


class FaultKind(enum.Enum):
    """What failed; the value is summary.json's `what` of the fault's entry."""

    ROLLOUT_ACTOR_DIED = "rollout actor died"  # faults/rollout_actors.py: replaced on its slot, jobs run again
    TRAIN_RANK_DIED = "train rank died"  # faults/restart.py: the train group rebuilt, resumed from a checkpoint
    STORE_HOLDER_DIED = "store holder died"  # faults/restart.py: the store replaced, the step run again or resumed
    REWARD_FAILED = "reward failed"  # faults/data.py: the group left out
    ENVIRONMENT_FAILED = "environment failed"  # faults/data.py: the group left out

    @classmethod
    def data(cls, reason: str) -> "FaultKind":
        """The kind of a failed group whose `reason` (rollout/retries.py REASONS) call failed on every try."""
        return cls(f"{reason} failed")


class RolloutActorError(DataPlaneError, RuntimeError):
    """A rollout actor died; the rows it owed never arrive."""


def first_line(e: BaseException | str) -> str:
    """An error's (or a text's) first line; an error without text: its type's name."""
    text = str(e).strip()
    return text.splitlines()[0] if text else type(e).__name__
