"""Failed groups on the driver's side (docs/architecture.md §7): counted, named in one line, left out, bounded by a budget.

A rollout job's receipt names the groups whose reward or environment call failed on every try
(rollout/retries.py); their rows were never written. The driver reads a round's written rows only
(driver/rollouts.py `Rollouts.read`) and leaves the failed groups out of the step (collect_groups takes their
places from a further round); here each failed group is printed in one line and listed in summary.json's
`faults`, and the run stops with DataFailureError once more than `fault_tolerance.max_failed_groups` groups have
failed.
"""

from __future__ import annotations

import sys

from dataplane_rl.config import Config
from dataplane_rl.errors import DataPlaneError
from dataplane_rl.run.ledger import FaultKind, FaultLedger


class DataFailureError(DataPlaneError, RuntimeError):
    """More groups failed (a reward or environment call raising on every try) than fault_tolerance.max_failed_groups."""


class DataFaults:
    """The failed groups of a run's rounds (its config `cfg`), recorded in the run's `ledger`."""

    def __init__(self, cfg: Config, ledger: FaultLedger) -> None:
        self.cfg, self.ledger = cfg, ledger
        ft = cfg.fault_tolerance
        self.budget, self.tries = ft.max_failed_groups, ft.max_data_retries + 1

    def take(self, step: int, pid: str, receipts: list[dict]) -> list[int]:
        """Account a collected round's data faults (retries by reason; every failed group recorded, the run stopped
        past the budget); returns the rows the failed groups never wrote."""
        failed_rows = []
        for r in receipts:
            for reason, n in r.get("data_retries", {}).items():
                self.ledger.data_retries[reason] = self.ledger.data_retries.get(reason, 0) + int(n)
            for group, reason, error in r.get("failed_groups", ()):
                self.fail(step, pid, int(group), reason, error)
            failed_rows += r.get("failed_rows", ())
        return failed_rows

    def fail(self, step: int, pid: str, group: int, reason: str, error: str) -> None:
        ledger = self.ledger
        ledger.failed_groups += 1
        task = self.cfg.task.name
        what = (f"step {step}: task '{task}' group {group} (partition {pid}): its {reason} call raised {error} on each "
                f"of {self.tries} tries (fault_tolerance.max_data_retries={self.tries - 1})")
        if ledger.failed_groups > self.budget:
            raise DataFailureError(f"{what}; fault_tolerance.max_failed_groups={self.budget} groups have failed "
                                   "already, so the run stops here; fix the task's code or raise the budget")
        ledger.fault(FaultKind.data(reason), step, {"task": task, "partition": pid, "group": group}, error,
                     "group left out, its place taken from a further round",
                     {"rows_left_out": self.cfg.grpo.num_generations_per_prompt},
                     {"used": ledger.failed_groups, "of": self.budget, "key": "fault_tolerance.max_failed_groups"})
        print(f"{what}; the whole group is left out, never trained; fault_tolerance.max_failed_groups: {ledger.failed_groups} "
              f"of {self.budget} used", file=sys.stderr, flush=True)
