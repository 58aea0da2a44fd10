"""In-run recoveries that rebuild part of the run (docs/architecture.md §7): a dead train rank, a dead holder of the run's store.

- **A holder (or the master) of the run's own Mooncake store** (`mooncake://`, started by the run) dies: its rows
  die with it. The store is replaced by a new one (a new master and holders) and every actor opens it. In sync
  GRPO, before the step's optimizer steps, the step then runs again from its start: its prompts and every
  sample's seed are its own and the weights are still those that generated it, so the regenerated rows, and
  the log-probs recomputed from them, are the lost ones; after them the step reads nothing more from the store
  that it needs (driver/step.py grpo_step; an on-policy step's prev_logprobs column and rollouts file, written
  then, go with the store's rows), so it goes on. In async GRPO (rows generated ahead with weights that are gone)
  the run resumes from its last checkpoint, in-process.
- **A train rank** dies (checkpointing on): every actor is killed (the survivors may wait in a collective for the
  dead rank), new ones are made with a new process group, and the run resumes from its last checkpoint in-process,
  which restores the train state, the rollout actors' RNG and async GRPO's rounds generated ahead (checkpoint/).
Ray stays up. Steps run again write their metrics line again, marked `faults/rerun` (how many lines of the step
came before); the last line of a step is the one that counts. `fault_tolerance.max_restarts` bounds both over
the run; without a checkpoint to resume from, or with the budget spent, the run stops with the error naming the
process and the key that would have saved it.
"""

from __future__ import annotations

import sys
import time
from dataclasses import dataclass

from dataplane_rl.faults.kinds import first_line
from dataplane_rl.faults.ports import TrainGroup
from dataplane_rl.run.ledger import FaultKind
from dataplane_rl.run.progress import Progress
from dataplane_rl.faults.train_ranks import dead_rank, save_output, train_rank_error
from dataplane_rl.errors import StoreUnavailableError

PROBE_S = 3.0  # how long a train rank may take to answer "are you alive" (a busy one is alive: only death answers fast)


@dataclass
class Fault:
    what: FaultKind  # TRAIN_RANK_DIED or STORE_HOLDER_DIED
    where: dict
    error: str  # its first line
    exc: BaseException
    detail: str = ""  # the store's description of the dead process
    output: str | None = None  # where the dead rank's last output went


def probe_dead_rank(group: TrainGroup) -> int | None:
    """The first train rank whose actor is dead (a dead actor answers at once; a busy one is left alone)."""
    import ray

    calls = [w.__ray_ready__.remote() for w in group.ranks()]
    done, _ = ray.wait(calls, num_returns=len(calls), timeout=PROBE_S)
    for rank, call in enumerate(calls):
        if call in done:
            try:
                ray.get(call)
            except ray.exceptions.RayActorError:
                return rank
    return None


class RunRestarts:
    """In-run restarts: classify a step's failure, swap the store or resume with a new train group (`new_fleet()`,
    started here); what they cost goes to the run's `ledger`. Each method takes the train group of the moment."""

    def __init__(self, cfg, run_dir, ckpt, ledger, new_fleet=None, replay=None) -> None:
        self.cfg, self.run_dir, self.ckpt, self.ledger, self.new_fleet = cfg, run_dir, ckpt, ledger, new_fleet
        self.replay = replay  # the group replay buffer (grpo.replay), restored with the checkpoint on resume
        self.budget = cfg.fault_tolerance.max_restarts

    @property
    def used(self) -> int:
        return self.ledger.restarts_used

    # -- what failed --------------------------------------------------------------------------------
    def classify(self, group: TrainGroup, e: BaseException) -> Fault | None:
        """A dead process this module recovers from, or None (the error is not one: it ends the run as before)."""
        import ray

        dead = group.dead_store_processes(e)
        if dead:
            return Fault(FaultKind.STORE_HOLDER_DIED, {"store": group.store_address()},
                         first_line(dead[0]).split("; last lines")[0], e, "\n".join(dead))
        if not group.ranks() or not isinstance(e, ray.exceptions.RayError):
            return None
        rank = dead_rank(group, e)
        if rank is None:  # a survivor's error (gloo: the peer closed the connection), or a rollout's: ask
            rank = probe_dead_rank(group)
        if rank is None:
            return None
        pid, node = group.rank_where(rank)
        return Fault(FaultKind.TRAIN_RANK_DIED, {"rank": rank, "pid": pid, "node": node}, first_line(e), e,
                     output=str(save_output(group, rank, self.run_dir)))

    # -- what to do ---------------------------------------------------------------------------------
    def can_regenerate(self, group: TrainGroup, progress: Progress, step_trained: bool = False) -> bool:
        """A lost store costs at most the step under way: sync GRPO, before the step's optimizer steps (its rows are
        made again) or after the step returned (it read what it needed before them: grpo_step). Not while the replay
        buffer holds groups: their rows died with the store (a checkpoint holds them)."""
        held = progress.replay is not None and bool(progress.replay.pinned())
        return not group.generates_ahead() and not held and (not progress.trained or step_trained)

    def refusal(self, group: TrainGroup, progress: Progress, fault: Fault, step: int, saved_step: int | None,
                step_trained: bool = False) -> BaseException | None:
        """The error the run stops with, or None when it can recover."""
        budget = f"fault_tolerance.max_restarts={self.budget}"
        spent = self.used >= self.budget
        if fault.what is FaultKind.TRAIN_RANK_DIED:
            if self.cfg.checkpointing.enabled and saved_step is not None and not spent:
                return None
            err = train_rank_error(group, self.cfg.checkpointing, fault.exc, step, self.run_dir, saved_step,
                                   fault.where["rank"])
            if spent and self.cfg.checkpointing.enabled and saved_step is not None:
                err.args = (f"{err.args[0]}; {budget}: the run restarted {self.used} time(s) already",)
            return err
        if not spent and (self.can_regenerate(group, progress, step_trained) or (self.cfg.checkpointing.enabled and saved_step is not None)):
            return None
        if spent:
            why = f"{budget}: the run restarted {self.used} time(s) already"
        elif self.cfg.checkpointing.enabled:
            why = (f"its rows were generated with weights the run no longer has, and no checkpoint was saved yet "
                   f"(checkpointing.save_period={self.cfg.checkpointing.save_period})")
        else:
            why = ("its rows were generated with weights the run no longer has; checkpointing.enabled=true would "
                   "have let the run resume from its last checkpoint")
        return StoreUnavailableError(f"step {step}: {fault.detail}\nThe data that process held died with it; the run "
                                     f"stops here: {why}")

    def record(self, fault: Fault, step: int, recovery: str, cost: dict) -> None:
        self.ledger.fault(fault.what, step, fault.where, fault.error, recovery, cost,
                          {"used": self.used, "of": self.budget, "key": "fault_tolerance.max_restarts"},
                          during=f"step {step}", **({"output": fault.output} if fault.output else {}))
        self.ledger.seconds_lost += cost["seconds_lost"]
        name = (f"train rank {fault.where['rank']} (pid {fault.where['pid']} on {fault.where['node']})"
                if fault.what is FaultKind.TRAIN_RANK_DIED else "a process of the run's Mooncake store")
        print(f"step {step}: {name} died ({fault.error}); {recovery} in {cost['seconds_to_recover']:.1f} s"
              + (f"; its last output is in {fault.output}" if fault.output else "")
              + f"; fault_tolerance.max_restarts: {self.used} of {self.budget} used", file=sys.stderr, flush=True)

    def swap_store(self, group: TrainGroup, fault: Fault, step: int, step_started: float, step_trained: bool = False) -> None:
        """Replace the run's store and have every actor open the new one; the step then runs again from its start,
        or, `step_trained`, goes on from where it was."""
        t0 = time.perf_counter()
        url = group.reopen_store()
        self.ledger.store_restarts += 1
        now = time.perf_counter()
        then = ("went on with the step, trained before the loss" if step_trained else
                f"ran step {step} again from its start (same prompts, seeds and weights)")
        self.record(fault, step, f"replaced the store with {url} and {then}",
                    {"steps_rerun": 0, "seconds_to_recover": round(now - t0, 3),
                     "seconds_lost": round(now - (t0 if step_trained else step_started), 3)})

    def resume(self, old: TrainGroup, fault: Fault, step: int, attach):
        """A new fleet (new actors, process group and store, on the same Ray) restored from the last
        checkpoint; `attach(fleet)` wires it to the run folder. Returns it and the first step to run."""
        t0 = time.perf_counter()
        try:
            old.close(kill=True)
        except Exception as e:  # noqa: BLE001 - the old actors are killed whatever their store said
            print(f"step {step}: closing the failed train group: {type(e).__name__}: {first_line(e)}",
                  file=sys.stderr, flush=True)
        new = self.new_fleet()
        try:
            new.start()
            path = self.ckpt.find()
            first = self.ckpt.load(new, path, self.ckpt.check(path), self.replay) + 1
            attach(new)
        except BaseException:
            new.close()
            raise
        ledger = self.ledger
        rerun = sum(1 for s in ledger.lines if s >= first)
        ledger.steps_rerun += rerun
        if fault.what is FaultKind.TRAIN_RANK_DIED:
            ledger.train_restarts += 1
        else:
            ledger.store_restarts += 1
        now = time.perf_counter()
        again = f"steps {first}-{step}" if step > first else f"step {first}"
        self.record(fault, step, f"resumed in the run from the checkpoint of step {first - 1} with a new "
                    f"{'train group' if fault.what is FaultKind.TRAIN_RANK_DIED else 'store and actors'} ({again} run again)",
                    {"steps_rerun": rerun, "seconds_to_recover": round(now - t0, 3),
                     "seconds_lost": round(now - ledger.saved_at, 3)})
        return new, first
