"""The run's fault ledger: every fault it survived, the run-total counters and the restart budget used.

One ledger per run (the Run owns it, run/run.py); the processes it records come and go (an in-run resume makes
a new Fleet), the ledger stays, so nothing is copied from an old fleet to a new one. The fault handlers
(faults/) write it; every step's metrics line and summary.json's `faults` read it.
"""

from __future__ import annotations

import collections
import time

from dataplane_rl.rollout.retries import REASONS


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

    def record(self, entry: dict) -> None:
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
