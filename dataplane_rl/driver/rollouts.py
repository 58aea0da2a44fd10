"""Where a step's rollout partitions come from: generated on demand (sync) or ahead of the trainer (async).

Versions count training steps: the initial weights are version 0 and the weights after step k are version
k, which the refit after step k hands to the rollout actors. A Ray actor runs one call at a time, in the
order the driver sent them, so a refit lands between generation batches, never inside one, and a batch
generates with the weights of the last refit sent before it. Sync mode sends step k's batch after refit
k-1; async mode with age a sends it after refit max(0, k-1-a), so step k+1..k+a generate while step k
trains. Each row records the version that generated it (`generation_policy_version`, written by the actor).
"""

from __future__ import annotations

import time

import numpy as np

from dataplane_rl import trace
from dataplane_rl.errors import DataPlaneError, StoreTimeoutError, format_rows
from dataplane_rl.faults.data import DataFaults
from dataplane_rl.faults.rollout_actors import RolloutRecovery
from dataplane_rl.rollout.worker import Pending, RolloutJob
from dataplane_rl.run.progress import Progress


class RolloutWaitError(DataPlaneError, TimeoutError):
    """A step's rollout groups did not all arrive within grpo.async_grpo.wait_timeout_s."""


class Rollouts:
    """Sends generation rounds to the rollout actors of `fleet` (driver/fleet.py) with the weights of the run's
    `progress`, and takes them back whole through the transport; a dead actor goes to `recovery`, a failed group
    to `data_faults`."""

    def __init__(self, fleet, progress: Progress, recovery: RolloutRecovery, data_faults: DataFaults) -> None:
        self.fleet, self.progress, self.recovery, self.data_faults = fleet, progress, recovery, data_faults
        a = fleet.cfg.grpo.async_grpo
        self.ahead = a.max_trajectory_age_steps if a.enabled else None  # None: sync, nothing sent ahead
        self.timeout = a.wait_timeout_s
        self.pending: dict[int, Pending] = {}  # step -> its round-0 batch, sent ahead (async)
        self.open: dict[str, Pending] = {}  # every round sent and not yet collected, in send order (faults/rollout_actors.py)
        self.fields = [c.name for c in fleet.schema.columns if c.writer == "rollout"]

    # -- sending ------------------------------------------------------------------------------------
    def send(self, pid: str, step: int, round_: int, prompts: list, G: int, group_offset: int = 0,
             validation: bool = False) -> Pending:
        t, version = self.fleet, self.progress.version
        t.store.create_partition(pid, t.schema, len(prompts) * G)
        splits = np.array_split(np.arange(len(prompts)), t.cfg.generation.num_workers)
        jobs = [RolloutJob(pid, step, round_, int(s[0]) * G, (s + group_offset).tolist(), [prompts[i] for i in s],
                           validation=validation, weights=version) for s in splits if s.size]
        p = self.open[pid] = Pending(pid, step, G, jobs, t.dispatch(jobs), version)
        return p

    def send_round(self, step: int, round_: int, n: int | None = None) -> Pending:
        """Round `round_` of `step`: n prompts (default grpo.num_prompts_per_step; fewer when the replay buffer
        gives the rest), each generated grpo.num_generations_per_prompt times."""
        g = self.fleet.cfg.grpo
        pid = f"step-{step:06d}" if round_ == 0 else f"step-{step:06d}-r{round_}"
        prompts = self.fleet.sampler.draw(g.seed, step, round_, n or g.num_prompts_per_step)
        return self.send(pid, step, round_, prompts, g.num_generations_per_prompt)

    def send_ahead(self, version: int) -> None:
        """Async: with weights `version` just sent, send every step that may use them: k <= version+1+age."""
        if self.ahead is None:
            return
        last = min(version + 1 + self.ahead, self.fleet.cfg.grpo.max_num_steps)
        for k in range(version + 1, last + 1):
            if k not in self.pending:
                self.pending[k] = self.send_round(k, 0)

    def put_ahead(self, p: Pending) -> None:
        """Schedule round `p`, whose rows are in the store already, for its step (a checkpoint's: checkpoint/ahead.py)."""
        self.pending[p.step] = p

    def forget(self) -> None:
        """The store that held every round in flight is gone (faults/restart.py): none of them will arrive."""
        self.open, self.pending = {}, {}

    def first_round(self, step: int, n: int | None = None) -> Pending:
        return self.pending.pop(step, None) or self.send_round(step, 0, n)

    # -- taking back --------------------------------------------------------------------------------
    @trace.traced("wait_for_rollouts")
    def collect(self, p: Pending, io=None) -> list[dict]:
        """Block until every row of the round is in the store (store.wait, in slices that check the actors
        are alive), land it (data plane off) and return the receipts. A timeout names step and groups; a
        dead actor is replaced and its unfinished jobs run again (faults/rollout_actors.py), within the budget."""
        from ray.exceptions import RayActorError

        t0 = time.perf_counter()
        rows = [np.arange(j.row_start, j.row_start + len(j.prompts) * p.G) for j in p.jobs]
        while True:
            try:
                receipts = self.fleet.wait_rows(p.pid, list(zip(rows, p.futures)), self.fields, self.timeout)
                break
            except StoreTimeoutError:
                raise RolloutWaitError(self._missing(p)) from None
            except RayActorError as e:
                self.recovery.survive(e, f"step {p.step}: waiting for partition {p.pid}")
        self.open.pop(p.pid, None)
        for i, r in enumerate(receipts):  # job i ran on rollout actor i (send), or on its replacement in slot i
            trace.absorb(r.pop("trace", None), f"rollout-{i}")
        self.recovery.collected(receipts)
        if io is not None:
            for r in receipts:
                io.add(r)
            io.timing["wait_for_rollouts"] = io.timing.get("wait_for_rollouts", 0.0) + time.perf_counter() - t0
        return receipts

    def read(self, step: int, p: Pending, receipts: list[dict], fields, io) -> tuple:
        """A collected round's `fields` on its written rows, and those rows: a group whose reward or environment
        failed on every try wrote none (faults/data.py accounts it and stops the run past its budget)."""
        failed_rows = self.data_faults.take(step, p.pid, receipts)
        t0 = time.perf_counter()
        if failed_rows:
            rows = np.setdiff1d(np.arange(sum(len(j.prompts) for j in p.jobs) * p.G), failed_rows)
            sc = self.fleet.store.get(p.pid, fields, rows)
        else:
            sc = self.fleet.store.get(p.pid, fields)
            rows = np.arange(sc.num_rows)
        io.get_s += time.perf_counter() - t0
        io.driver_bytes_read += sc.nbytes
        return sc, rows

    def _missing(self, p: Pending) -> str:
        done = set(self.fleet.store.ready(p.pid, self.fields).tolist())
        groups = [gid for j in p.jobs for i, gid in enumerate(j.group_ids)
                  if not set(range(j.row_start + i * p.G, j.row_start + (i + 1) * p.G)) <= done]
        return (f"step {p.step}: partition {p.pid} groups {format_rows(groups)} not complete after {self.timeout:g} s "
                "(grpo.async_grpo.wait_timeout_s); check that the rollout actors are alive and not overloaded, "
                "or raise the timeout")

    def close(self) -> None:
        """Drop the partitions sent ahead that no step took (best effort: the store may be gone)."""
        for p in self.pending.values():
            try:
                self.fleet.store.drop_partition(p.pid)
            except Exception:  # noqa: BLE001 - closing after a failure: the store or partition may be gone
                pass
        self.pending, self.open = {}, {}


def fresh_groups(versions: np.ndarray, groups: np.ndarray, oldest: int) -> tuple[np.ndarray, int]:
    """Groups all of whose rows have version >= `oldest`, and how many rows the older groups hold."""
    ids = np.unique(groups)
    ok = np.array([versions[groups == gid].min() >= oldest for gid in ids], dtype=bool)
    return ids[ok], int(np.isin(groups, ids[~ok]).sum())
