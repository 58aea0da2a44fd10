"""Rollout actors that die mid-run (docs/architecture.md §7): replaced on their slot, their unfinished jobs dispatched again.

A rollout row depends only on its seed (grpo.seed, step, round, group, sample) and on the weights its job was
sent with, so a job run again on a fresh actor writes the same cells. The replacement is made on the dead
actor's placement bundle, loads, in send order, the weights each of its unfinished jobs was sent with (the
driver keeps the object-store reference of every version an open job still needs), runs those jobs again, and
ends on the current weights. A retried job writes only the cells its first attempt did not commit (cells are
written once). `fault_tolerance.max_generation_failures` bounds the replacements over the run.
"""

from __future__ import annotations

import dataclasses
import json
import sys
import time
from pathlib import Path

from dataplane_rl.faults.kinds import RolloutActorError, first_line
from dataplane_rl.faults.ports import RolloutSlots
from dataplane_rl.run.ledger import FaultKind, FaultLedger
from dataplane_rl.run.progress import Progress


class RolloutRecovery:
    """Dead rollout actors in `slots` replaced and their jobs run again, within `budget` replacements
    (fault_tolerance.max_generation_failures); the weights and pending refits are the run's `progress`, what it
    costs goes to the run's `ledger`."""

    def __init__(self, slots: RolloutSlots, progress: Progress, ledger: FaultLedger, budget: int) -> None:
        self.slots, self.progress, self.ledger, self.budget = slots, progress, ledger, budget
        self.weights: dict[int, object] = {}  # weight version -> its state-dict reference, while an open job needs it
        self.actors_file: Path | None = None

    # -- the actors ---------------------------------------------------------------------------------
    def record(self, run_dir: Path) -> None:
        """Keep RUN_DIR/actors.json (each rollout actor's and train rank's PID and node, and the processes of the
        run's own Mooncake store) up to date from now on."""
        self.actors_file = Path(run_dir) / "actors.json"
        self.write()

    def write(self) -> None:
        if self.actors_file is None:
            return
        tmp = self.actors_file.with_suffix(".json.tmp")
        tmp.write_text(json.dumps(self.slots.processes(), indent=2) + "\n")
        tmp.replace(self.actors_file)

    def keep_weights(self, version: int, ref) -> None:
        """Record the refit of `version`; forget versions no open job was sent with."""
        self.weights[version] = ref
        need = {p.version for p in self.slots.open_rounds()} | {version}
        self.weights = {v: r for v, r in self.weights.items() if v in need}

    # -- noticing a death ---------------------------------------------------------------------------
    def dead_slots(self, extra: list = ()) -> set[int]:
        """Slots whose actor's call failed because the actor died: over every open job and `extra`
        [(slot, actor, future)]. A call that failed inside a live actor is not a death."""
        import ray
        from ray.exceptions import RayActorError

        actors = self.slots.actors()
        calls = [(i, f) for p in self.slots.open_rounds() for i, f in enumerate(p.futures)]
        calls += [(i, f) for i, a, f in [*extra, *self.progress.refits] if a is actors[i]]
        if not calls:
            return set()
        done, _ = ray.wait([f for _, f in calls], num_returns=len(calls), timeout=0)
        done, dead = set(done), set()
        for i, f in calls:
            if f in done and i not in dead:
                try:
                    ray.get(f, timeout=0)
                except RayActorError:
                    dead.add(i)
                except Exception:  # noqa: BLE001 - an error inside a live actor is its caller's to raise
                    pass
        return dead

    def survive(self, e: BaseException, what: str, extra: list = ()) -> None:
        """After a call to a rollout actor raised RayActorError `e`: replace every dead actor and run its
        unfinished jobs again, or raise RolloutActorError when none is found dead or the budget is spent."""
        dead = self.dead_slots(extra)
        if not dead:
            raise self.stop(e, what) from None
        for slot in sorted(dead):
            if self.ledger.actor_restarts >= self.budget:
                raise self.stop(e, what, spent=True) from None
            self.replace(slot, what, first_line(e))

    def stop(self, e: BaseException, what: str, spent: bool = False) -> RolloutActorError:
        why = (f" (fault_tolerance.max_generation_failures={self.budget}: {self.ledger.actor_restarts} replaced already)"
               if spent else "")
        return RolloutActorError(f"{what}: a rollout actor died ({first_line(e)}); the run stops here{why}, its folder "
                                 "keeps the steps completed; see the actor's log under /tmp/ray/session_latest/logs")

    # -- the replacement ----------------------------------------------------------------------------
    def replace(self, slot: int, what: str, error: str) -> None:
        slots, ledger = self.slots, self.ledger
        t0 = time.perf_counter()
        old_pid, node = slots.where(slot)
        ledger.actor_restarts += 1
        try:
            pid = slots.replace_rollout(slot)
        except Exception as e:  # noqa: BLE001 - any failure to start ends the run, as the death did before
            raise RolloutActorError(f"{what}: rollout actor {slot} died ({error}) and its replacement did not start "
                                    f"({first_line(e)}); the run stops here, its folder keeps the steps completed") from None
        new_node = slots.where(slot)[1]
        jobs, rows = self.redispatch(slot, slots.actors()[slot])
        lost = time.perf_counter() - t0
        ledger.seconds_lost += lost
        ledger.redispatched += jobs
        ledger.fault(FaultKind.ROLLOUT_ACTOR_DIED, self.progress.in_step, {"slot": slot, "pid": old_pid, "node": node},
                     error, f"replaced by pid {pid} on {new_node}",
                     {"jobs_redispatched": jobs, "rows_redispatched": rows, "seconds_to_replace": round(lost, 3)},
                     {"used": ledger.actor_restarts, "of": self.budget, "key": "fault_tolerance.max_generation_failures"},
                     during=what)
        print(f"{what}: rollout actor {slot} (pid {old_pid} on {node}) died ({error}); replaced by pid {pid}, "
              f"{jobs} unfinished job(s) ({rows} rows) dispatched again; fault_tolerance.max_generation_failures: "
              f"{ledger.actor_restarts} of {self.budget} used", file=sys.stderr, flush=True)
        self.write()

    def redispatch(self, slot: int, actor) -> tuple[int, int]:
        """Send the slot's unfinished jobs of every open round to `actor`, in send order, each after the
        weights it was first sent with; end on the current weights. Returns (jobs, rows) sent."""
        loaded, jobs, rows = 0, 0, 0  # a new actor holds the initial weights, version 0
        for p in self.slots.open_rounds():
            if slot >= len(p.jobs) or succeeded(p.futures[slot]):
                continue
            if p.version != loaded:
                actor.load_weights.remote(self.weights[p.version], p.version)
                loaded = p.version
            job = dataclasses.replace(p.jobs[slot], retry=True)
            p.futures[slot] = actor.generate.remote(job)
            jobs, rows = jobs + 1, rows + len(job.group_ids) * p.G
        now = self.progress
        if now.policy_ref is not None and loaded != now.version:
            # sync: lands before the next round's call; async: checked with the other refits
            now.refits.append((slot, actor, actor.load_weights.remote(now.policy_ref, now.version)))
        return jobs, rows

    # -- calls on every actor -----------------------------------------------------------------------
    def on_all(self, what: str, method: str, *per_slot_args) -> list:
        """`method` on every rollout actor (with its slot's arguments), its results in slot order; an actor
        found dead is replaced (within the budget) and asked again."""
        import ray
        from ray.exceptions import RayActorError

        while True:
            calls = [(i, a, getattr(a, method).remote(*(args[i] for args in per_slot_args)))
                     for i, a in enumerate(self.slots.actors())]
            try:
                return ray.get([f for _, _, f in calls])
            except RayActorError as e:
                self.survive(e, what, calls)

    def settle_refits(self, what: str) -> float:
        """Async: the slowest confirmed refit's seconds; the unconfirmed stay pending. A dead actor is replaced."""
        import ray
        from ray.exceptions import RayActorError

        while True:
            pending, refits = self.progress.refits, list(self.progress.refits)
            done, _ = ray.wait([f for _, _, f in refits], num_returns=len(refits), timeout=0)
            done = set(done)
            pending[:] = [r for r in refits if r[2] not in done]
            try:
                return max(ray.get([f for _, _, f in refits if f in done]), default=0.0)
            except RayActorError as e:
                pending += [r for r in refits if r[2] in done]  # dead_slots() looks at them
                self.survive(e, what)
                pending[:] = [r for r in pending if r[2] not in done]

    def collected(self, receipts: list[dict]) -> None:
        """Count the rows a retried job wrote (the cells its first attempt had not committed) and its seconds."""
        again = [r for r in receipts if "rows_regenerated" in r]
        self.ledger.rows_regenerated += sum(int(r["rows_regenerated"]) for r in again)
        self.ledger.seconds_lost += sum(float(r["generate_s"]) for r in again)


def succeeded(future) -> bool:
    """Whether a Ray call is done without error (failed for any reason: run it again)."""
    import ray

    if not ray.wait([future], timeout=0)[0]:
        return False
    try:
        ray.get(future, timeout=0)
        return True
    except Exception:  # noqa: BLE001 - failed for any reason: run it again
        return False
