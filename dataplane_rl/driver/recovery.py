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
from datetime import datetime, timezone
from pathlib import Path

from dataplane_rl.driver.rollouts import RolloutActorError


def first_line(e: BaseException | str) -> str:
    """An error's (or a text's) first line; an error without text: its type's name."""
    text = str(e).strip()
    return text.splitlines()[0] if text else type(e).__name__


class RolloutRecovery:
    """The driver's record of the rollout actors (pid, node) and of the faults the run survived."""

    def __init__(self, trainer) -> None:
        self.t = trainer
        self.budget = trainer.cfg.fault_tolerance.max_generation_failures
        self.spec: tuple = ()  # (config dict, torch threads, GPUs per actor): what start() made the actors with
        self.pids: list[int] = []
        self.weights: dict[int, object] = {}  # weight version -> its state-dict reference, while an open job needs it
        self.faults: list[dict] = []  # summary.json's `faults`
        self.restarts = self.redispatched = self.rows = 0
        self.seconds_lost = 0.0
        self.actors_file: Path | None = None

    # -- the actors ---------------------------------------------------------------------------------
    def spawn(self, slot: int):
        """A rollout actor on bundle `slot` of the rollout placement group (not yet ready)."""
        from dataplane_rl.driver import placement
        from dataplane_rl.rollout.worker import actor_class

        cfg_dict, threads, gpus = self.spec
        cls = actor_class(self.t.cfg.grpo.async_grpo.in_flight_weight_updates)
        return cls.options(**placement.options(self.t._groups[0], slot, gpus)).remote(
            cfg_dict, self.t.model_folder, self.t.store_url, threads)

    def record(self, run_dir: Path) -> None:
        """Keep RUN_DIR/actors.json (each rollout actor's and train rank's PID and node, and the processes of the
        run's own Mooncake store) up to date from now on."""
        self.actors_file = Path(run_dir) / "actors.json"
        self.write()

    def write(self) -> None:
        if self.actors_file is None:
            return
        nodes = self.t.nodes.get("rollout", [])
        rows = [{"slot": i, "pid": pid, "node": nodes[i] if i < len(nodes) else None} for i, pid in enumerate(self.pids)]
        tmp = self.actors_file.with_suffix(".json.tmp")
        train = [{"rank": r, "pid": pid, "node": ip} for r, (pid, ip) in enumerate(zip(self.t.train_pids,
                                                                                   self.t.nodes.get("train", [])))]
        cluster = getattr(self.t.store, "cluster", None)  # the run's own Mooncake store: its master and holders
        store = [] if cluster is None or cluster.master is None else (
            [{"process": "master", "pid": cluster.master.pid, "node": cluster.host}]
            + [{"process": "holder", "index": h.index, "pid": h.pid, "node": cluster.host} for h in cluster.holders])
        tmp.write_text(json.dumps({"rollout": rows, "train": train, "store": store}, indent=2) + "\n")
        tmp.replace(self.actors_file)

    def counters(self) -> dict:
        """Run totals for every step's metrics line (0 on a run without faults)."""
        return {"rollout/redispatch_total": self.redispatched, "rollout/actor_restarts_total": self.restarts,
                "rollout/rows_regenerated_total": self.rows, "faults/seconds_lost_total": round(self.seconds_lost, 3)}

    def keep_weights(self, version: int, ref) -> None:
        """Record the refit of `version`; forget versions no open job was sent with."""
        self.weights[version] = ref
        need = {p.version for p in self.t.rollouts.open.values()} | {version}
        self.weights = {v: r for v, r in self.weights.items() if v in need}

    # -- noticing a death ---------------------------------------------------------------------------
    def dead_slots(self, extra: list = ()) -> set[int]:
        """Slots whose actor's call failed because the actor died: over every open job and `extra`
        [(slot, actor, future)]. A call that failed inside a live actor is not a death."""
        import ray
        from ray.exceptions import RayActorError

        calls = [(i, f) for p in self.t.rollouts.open.values() for i, f in enumerate(p.futures)]
        calls += [(i, f) for i, a, f in extra if a is self.t.rollout[i]]
        calls += [(i, f) for i, a, f in self.t._refits if a is self.t.rollout[i]]
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
            if self.restarts >= self.budget:
                raise self.stop(e, what, spent=True) from None
            self.replace(slot, what, first_line(e))

    def stop(self, e: BaseException, what: str, spent: bool = False) -> RolloutActorError:
        why = (f" (fault_tolerance.max_generation_failures={self.budget}: {self.restarts} replaced already)"
               if spent else "")
        return RolloutActorError(f"{what}: a rollout actor died ({first_line(e)}); the run stops here{why}, its folder "
                                 "keeps the steps completed; see the actor's log under /tmp/ray/session_latest/logs")

    # -- the replacement ----------------------------------------------------------------------------
    def replace(self, slot: int, what: str, error: str) -> None:
        import ray

        from dataplane_rl.driver import placement

        t0 = time.perf_counter()
        old, old_pid = self.t.rollout[slot], self.pids[slot]
        node = self.t.nodes["rollout"][slot]
        try:
            ray.kill(old)  # already dead: this only frees its name and resources at once
        except Exception:  # noqa: BLE001 - a dead actor may refuse the kill; it is gone either way
            pass
        self.t._refits = [(i, a, f) for i, a, f in self.t._refits if a is not old]
        self.restarts += 1
        actor = self.spawn(slot)
        try:
            pid = ray.get(actor.ready.remote(), timeout=placement.READY_TIMEOUT_S)
        except Exception as e:  # noqa: BLE001 - any failure to start ends the run, as the death did before
            raise RolloutActorError(f"{what}: rollout actor {slot} died ({error}) and its replacement did not start "
                                    f"within {placement.READY_TIMEOUT_S:.0f} s ({first_line(e)}); the run stops here, "
                                    "its folder keeps the steps completed") from None
        self.t.rollout[slot], self.pids[slot] = actor, pid
        self.t.nodes["rollout"][slot] = placement.node_ips([actor])[0]
        jobs, rows = self.redispatch(slot, actor)
        lost = time.perf_counter() - t0
        self.seconds_lost += lost
        self.redispatched += jobs
        self.faults.append({"time": datetime.now(timezone.utc).isoformat(timespec="seconds"), "step": self.t.in_step,
                            "during": what, "what": "rollout actor died", "where": {"slot": slot, "pid": old_pid, "node": node},
                            "error": error, "recovery": f"replaced by pid {pid} on {self.t.nodes['rollout'][slot]}",
                            "cost": {"jobs_redispatched": jobs, "rows_redispatched": rows,
                                     "seconds_to_replace": round(lost, 3)},
                            "budget": {"used": self.restarts, "of": self.budget,
                                       "key": "fault_tolerance.max_generation_failures"}})
        print(f"{what}: rollout actor {slot} (pid {old_pid} on {node}) died ({error}); replaced by pid {pid}, "
              f"{jobs} unfinished job(s) ({rows} rows) dispatched again; fault_tolerance.max_generation_failures: "
              f"{self.restarts} of {self.budget} used", file=sys.stderr, flush=True)
        self.write()

    def redispatch(self, slot: int, actor) -> tuple[int, int]:
        """Send the slot's unfinished jobs of every open round to `actor`, in send order, each after the
        weights it was first sent with; end on the current weights. Returns (jobs, rows) sent."""
        loaded, jobs, rows = 0, 0, 0  # a new actor holds the initial weights, version 0
        for p in self.t.rollouts.open.values():
            if slot >= len(p.jobs) or self._succeeded(p.futures[slot]):
                continue
            if p.version != loaded:
                actor.load_weights.remote(self.weights[p.version], p.version)
                loaded = p.version
            job = dataclasses.replace(p.jobs[slot], retry=True)
            p.futures[slot] = actor.generate.remote(job)
            jobs, rows = jobs + 1, rows + len(job.group_ids) * p.G
        if self.t.policy_ref is not None and loaded != self.t.version:
            # sync: lands before the next round's call; async: checked with the other refits
            self.t._refits.append((slot, actor, actor.load_weights.remote(self.t.policy_ref, self.t.version)))
        return jobs, rows

    @staticmethod
    def _succeeded(future) -> bool:
        import ray

        if not ray.wait([future], timeout=0)[0]:
            return False
        try:
            ray.get(future, timeout=0)
            return True
        except Exception:  # noqa: BLE001 - failed for any reason: run it again
            return False

    # -- calls on every actor -----------------------------------------------------------------------
    def on_all(self, what: str, method: str, *per_slot_args) -> list:
        """`method` on every rollout actor (with its slot's arguments), its results in slot order; an actor
        found dead is replaced (within the budget) and asked again."""
        import ray
        from ray.exceptions import RayActorError

        while True:
            calls = [(i, a, getattr(a, method).remote(*(args[i] for args in per_slot_args)))
                     for i, a in enumerate(self.t.rollout)]
            try:
                return ray.get([f for _, _, f in calls])
            except RayActorError as e:
                self.survive(e, what, calls)

    def settle_refits(self, what: str) -> float:
        """Async: the slowest confirmed refit's seconds; the unconfirmed stay pending. A dead actor is replaced."""
        import ray
        from ray.exceptions import RayActorError

        while True:
            refits = self.t._refits
            done, _ = ray.wait([f for _, _, f in refits], num_returns=len(refits), timeout=0)
            done = set(done)
            self.t._refits = [r for r in refits if r[2] not in done]
            try:
                return max(ray.get([f for _, _, f in refits if f in done]), default=0.0)
            except RayActorError as e:
                self.t._refits += [r for r in refits if r[2] in done]  # dead_slots() looks at them
                self.survive(e, what)
                self.t._refits = [r for r in self.t._refits if r[2] not in done]

    def collected(self, receipts: list[dict]) -> None:
        """Count the rows a retried job wrote (the cells its first attempt had not committed) and its seconds."""
        again = [r for r in receipts if "rows_regenerated" in r]
        self.rows += sum(int(r["rows_regenerated"]) for r in again)
        self.seconds_lost += sum(float(r["generate_s"]) for r in again)
