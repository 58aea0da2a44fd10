"""The run's fault ledger: every fault it survived, the run-total counters and the restart budget used.

One ledger per run (the Run owns it, run/run.py); the processes it records come and go (an in-run resume makes
a new Fleet), the ledger stays, so nothing is copied from an old fleet to a new one. The fault handlers
(faults/) write it; every step's metrics line and summary.json's `faults` read it.
"""

from __future__ import annotations

import collections
import enum
import time
from datetime import datetime, timezone

from dataplane_rl.rollout.retries import REASONS


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


class FaultLedger:
    def __init__(self) -> None:
        self.faults: list[dict] = []  # summary.json's `faults`, one entry per fault, in order
        # rollout actors replaced (faults/rollout_actors.py), their jobs and rows sent again
        self.actor_restarts = self.redispatched = self.rows_regenerated = 0
        self.seconds_lost = 0.0  # every recovery's cost in seconds
        # failed calls retried by reason and groups left out (faults/data.py)
        self.data_retries = dict.fromkeys(REASONS, 0)
        self.failed_groups = 0
        # in-run restarts (faults/restart.py) and the steps they ran again
        self.train_restarts = self.store_restarts = self.steps_rerun = 0
        self.lines: collections.Counter = collections.Counter()  # step -> metrics lines logged for it
        self.saved_at = time.perf_counter()  # when the latest checkpoint was complete (or the run started)

    @property
    def restarts_used(self) -> int:
        """Restarts counted against fault_tolerance.max_restarts."""
        return self.train_restarts + self.store_restarts

    def fault(self, kind: FaultKind, step: int, where: dict, error: str, recovery: str, cost: dict, budget: dict,
              during: str | None = None, **extra) -> None:
        """Record one fault survived as summary.json's entry for it (its time now, `what` the kind's value).
        `budget`: {used, of, key} of the config key that bounds faults of its kind."""
        entry = {"time": datetime.now(timezone.utc).isoformat(timespec="seconds"), "step": step,
                 **({"during": during} if during is not None else {}), "what": kind.value, "where": where,
                 "error": error, "recovery": recovery, "cost": cost, "budget": budget, **extra}
        self.faults.append(entry)

    def counters(self) -> dict:
        """Run totals of the rollout and data faults, in every step's metrics (0 on a run without faults)."""
        return {"rollout/redispatch_total": self.redispatched, "rollout/actor_restarts_total": self.actor_restarts,
                "rollout/rows_regenerated_total": self.rows_regenerated,
                "faults/seconds_lost_total": round(self.seconds_lost, 3),
                **{f"rollout/data_retries_total/{r}": n for r, n in self.data_retries.items()},
                "rollout/failed_groups_total": self.failed_groups}

    def restart_counters(self) -> dict:
        return {"faults/train_restarts_total": self.train_restarts, "faults/store_restarts_total": self.store_restarts,
                "faults/steps_rerun_total": self.steps_rerun}

    def mark(self, metrics: dict) -> None:
        """Add the restart counters and `faults/rerun` (lines of this step logged before) to a step's metrics line."""
        step = int(metrics["step"])
        metrics["faults/rerun"] = self.lines[step]
        self.lines[step] += 1
        metrics.update(self.restart_counters())
