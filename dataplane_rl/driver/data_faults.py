"""Failed groups on the driver's side (docs/architecture.md §7): counted, named in one line, left out, bounded by a budget.

A rollout job's receipt names the groups whose reward or environment call failed on every try
(rollout/retries.py); their rows were never written. The driver reads a round's written rows only, leaves the
failed groups out of the step (collect_groups takes their places from a further round), prints one line per
failed group, lists it in summary.json's `faults`, and stops the run with DataFailureError once more than
`fault_tolerance.max_failed_groups` groups have failed.
"""

from __future__ import annotations

import sys
import time
from datetime import datetime, timezone

import numpy as np

from dataplane_rl.errors import DataPlaneError
from dataplane_rl.rollout.retries import REASONS


class DataFailureError(DataPlaneError, RuntimeError):
    """More groups failed (a reward or environment call raising on every try) than fault_tolerance.max_failed_groups."""


class DataFaults:
    def __init__(self, trainer, faults: list) -> None:
        self.t = trainer
        ft = trainer.cfg.fault_tolerance
        self.budget, self.tries = ft.max_failed_groups, ft.max_data_retries + 1
        self.retries = dict.fromkeys(REASONS, 0)
        self.failed = 0
        self.faults = faults  # summary.json's list, shared with the rollout actors' recoveries

    def counters(self) -> dict:
        return {**{f"rollout/data_retries_total/{r}": n for r, n in self.retries.items()},
                "rollout/failed_groups_total": self.failed}

    def read_round(self, step: int, p, receipts: list[dict], fields, io) -> tuple:
        """A collected round's `fields` on its written rows, and those rows (the failed groups' are not)."""
        failed_rows = []
        for r in receipts:
            for reason, n in r.get("data_retries", {}).items():
                self.retries[reason] = self.retries.get(reason, 0) + int(n)
            for group, reason, error in r.get("failed_groups", ()):
                self.fail(step, p.pid, int(group), reason, error)
            failed_rows += r.get("failed_rows", ())
        t0 = time.perf_counter()
        if failed_rows:
            rows = np.setdiff1d(np.arange(sum(len(j.prompts) for j in p.jobs) * p.G), failed_rows)
            sc = self.t.store.get(p.pid, fields, rows)
        else:
            sc = self.t.store.get(p.pid, fields)
            rows = np.arange(sc.num_rows)
        io.get_s += time.perf_counter() - t0
        io.driver_bytes_read += sc.nbytes
        return sc, rows

    def fail(self, step: int, pid: str, group: int, reason: str, error: str) -> None:
        self.failed += 1
        task = self.t.cfg.task.name
        what = (f"step {step}: task '{task}' group {group} (partition {pid}): its {reason} call raised {error} on each "
                f"of {self.tries} tries (fault_tolerance.max_data_retries={self.tries - 1})")
        if self.failed > self.budget:
            raise DataFailureError(f"{what}; fault_tolerance.max_failed_groups={self.budget} groups have failed "
                                   "already, so the run stops here; fix the task's code or raise the budget")
        self.faults.append({"time": datetime.now(timezone.utc).isoformat(timespec="seconds"), "step": step,
                            "what": f"{reason} failed", "where": {"task": task, "partition": pid, "group": group},
                            "error": error, "recovery": "group left out, its place taken from a further round",
                            "cost": {"rows_left_out": self.t.cfg.grpo.num_generations_per_prompt},
                            "budget": {"used": self.failed, "of": self.budget, "key": "fault_tolerance.max_failed_groups"}})
        print(f"{what}; the whole group is left out, never trained; fault_tolerance.max_failed_groups: {self.failed} "
              f"of {self.budget} used", file=sys.stderr, flush=True)
