"""The GRPO run (docs/architecture.md §4): the Run (folder, loggers, Ray, fault ledger), its Fleet, checkpoints,
signals and the step loop.

One loop for every mode: the data plane on or off (driver/transport.py), sync or async GRPO
(driver/rollouts.py); the step's phases are driver/step.py's functions of (fleet, progress, step). The loop owns
the run's Progress (run/progress.py): each fleet it starts is made with a fresh one.
"""

from __future__ import annotations

import math
import signal
import sys
import time

from dataplane_rl import trace
from dataplane_rl.config import Config, dump_config
from dataplane_rl.errors import ConfigError, DataPlaneError
from dataplane_rl.driver import validation
from dataplane_rl.checkpoint import identity
from dataplane_rl.checkpoint.manager import CheckpointManager, step_of
from dataplane_rl.checkpoint.export import export_hf
from dataplane_rl.run.reaper import deferred_sigint
from dataplane_rl.run.preempt import LOST, TERMINATING, RayLost, StopSignals
from dataplane_rl.run.folder import RunDir
from dataplane_rl.run.memory import PeakMemory
from dataplane_rl.run.progress import Progress
from dataplane_rl.run.run import Run
from dataplane_rl.faults.kinds import RolloutActorError
from dataplane_rl.run.ledger import FaultKind
from dataplane_rl.faults.restart import RunRestarts
from dataplane_rl.faults.train_ranks import train_rank_error
from dataplane_rl.driver.rollouts import RolloutWaitError
from dataplane_rl.driver.step_io import DynamicSamplingError
from dataplane_rl.driver.fleet import Fleet
from dataplane_rl.driver.replay import ReplayBuffer
from dataplane_rl.driver.step import grpo_step
from dataplane_rl.driver.preflight import open_run_store, preflight

__all__ = ["DynamicSamplingError", "Fleet", "NonFiniteError", "RolloutActorError", "RolloutWaitError", "StepProgress",
           "check_finite", "grpo_step", "open_run_store", "preflight", "train"]


class StepProgress:
    """The console bar: it advances when a step ends, showing that step's numbers (never step k's at k-1/N).
    Disabled (logger.progress=false), it prints one plain line every `every` steps and at the last."""

    def __init__(self, total: int, enabled: bool = True, file=None, mininterval: float = 0.1, initial: int = 0,
                 every: int = 10) -> None:
        from tqdm import tqdm

        # initial: steps already done (a resumed run starts its bar there)
        self.bar = tqdm(total=total, initial=initial, desc="grpo", unit="step", disable=not enabled,
                        dynamic_ncols=True, file=file, mininterval=mininterval)
        self.enabled, self.file, self.every, self.total, self.done = enabled, file, every, total, initial

    def step_done(self, metrics: dict) -> None:
        self.bar.set_postfix(reward=f"{metrics['train/reward']:.3f}", loss=f"{metrics['train/loss']:.4f}",
                             step_s=f"{metrics['timing/step']:.1f}", refresh=False)
        self.bar.update(1)
        self.done += 1
        if not self.enabled and (self.done % self.every == 0 or self.done == self.total):
            print(f"grpo step {self.done}/{self.total}: reward {metrics['train/reward']:.3f} loss "
                  f"{metrics['train/loss']:.4f} step_s {metrics['timing/step']:.1f}",
                  file=self.file or sys.stderr, flush=True)

    def rewind(self, done: int) -> None:
        """Back to `done` steps (an in-run resume from the checkpoint of step `done`: faults/restart.py)."""
        self.done = self.bar.n = done
        self.bar.refresh()

    def close(self) -> None:
        self.bar.close()


class NonFiniteError(DataPlaneError):
    """A training step produced a loss or gradient norm that is NaN or infinite."""


def check_finite(metrics: dict) -> None:
    """Stop at the first step whose loss, gradient norm or weights are not finite: every later step would be NaN too."""
    for key in ("train/loss", "train/grad_norm", "train/param_norm"):
        value = metrics.get(key)
        if value is not None and not math.isfinite(value):
            raise NonFiniteError(f"step {metrics['step']}: {key} is {value}; the weights are no longer usable. "
                                 "Lower policy.learning_rate or policy.max_grad_norm, or check the rewards")


def release(store, pids) -> None:
    """Drop the partitions the replay buffer pinned, at the run's end (best effort: the store may be gone)."""
    for pid in sorted(pids) if store is not None else ():
        try:
            store.drop_partition(pid)
        except Exception:  # noqa: BLE001 - closing after a failure: the store or partition may be gone
            pass


def ray_lost(stop: StopSignals, run: Run | None) -> bool:
    """After a SIGTERM: whether Ray's processes went with it (a signal to the whole process group); if so,
    neither the handler nor close() may wait on Ray any more."""
    if stop.ray_lost or (stop.signum in TERMINATING and stop.ray_going()):
        stop.ray_lost = True
        LOST.set()
        if run is not None:
            run.ray.mark_lost()
    return stop.ray_lost


def train(cfg: Config, resume: bool = False, accept_mismatch: bool = False) -> dict:
    """Run GRPO as configured; returns the summary. The run folder is consistent however it ends: a run
    refused its folder (held by a live run, or holding a finished one) touches nothing there; any other
    failure, before or after the start, leaves a summary.json saying so.

    resume: continue the run in cfg.logger.run_dir from its latest complete checkpoint, which must be the run's
    own, saved on the data the run has now (checkpoint/identity.py), unless accept_mismatch (`--accept-mismatch`).
    SIGTERM/SIGHUP/SIGINT end the current step, checkpoint (when checkpointing is on) and return status
    'interrupted' with the signal's number in summary["signal"].
    """
    start = saved = data = None
    if resume:  # refused before the folder is opened, so a refusal leaves the run's summary as it was
        run_id = identity.read_run_id(cfg.logger.run_dir)
        ckpt = CheckpointManager.for_config(cfg, run_id)
        start = ckpt.find()  # its bytes verified against its manifest
        saved = ckpt.check(start)  # every file parsed, no code run, before Ray
        data = identity.check(cfg, start, step_of(start), saved.get("run"), run_id, accept_mismatch)
        if step_of(start) > cfg.grpo.max_num_steps:
            raise ConfigError(f"--resume: the latest checkpoint is step {step_of(start)}, past grpo.max_num_steps="
                              f"{cfg.grpo.max_num_steps}; raise grpo.max_num_steps to continue the run")
    run = Run(RunDir(cfg.logger.run_dir, overwrite=cfg.logger.overwrite, resume=resume))
    if cfg.logger.run_dir is None:  # the fresh runs/<time> folder: record it, so --resume and the checkpoints find it
        cfg = cfg.model_copy(deep=True)
        cfg.logger.run_dir = str(run.path)
    loop = RunLoop(cfg, run, start, data)
    try:
        with loop.stop:
            first = loop.open(saved)
            loop.steps(first)
            loop.end()
    except KeyboardInterrupt:
        if not loop.stop.abandoned:
            loop.status, loop.error = "interrupted", "KeyboardInterrupt"
            raise
        # a stop signal while the run started (preempt.StartInterrupted, or Ray's own KeyboardInterrupt for it):
        # 128 + the signal, as for a stop between steps
        loop.status, loop.error = "interrupted", signal.Signals(loop.stop.signum).name
    except BaseException as e:
        # a SIGTERM to the whole process group stopped Ray too: RayLost, or an actor's death seen first.
        # Stop now, without waiting on Ray, as the interrupted run it is (exit 143 all the same)
        if isinstance(e, RayLost) or ray_lost(loop.stop, run):
            sent = signal.Signals(loop.stop.signum).name if loop.stop.signum else "SIGTERM"
            loop.status, loop.error = "interrupted", f"{sent} to the process group: Ray's processes stopped with the driver"
        else:
            loop.error = run.folder.record_error(e)
            raise
    finally:
        summary = loop.close()
    return summary


class RunLoop:
    """One `train`: the Run, the Fleet of the moment and the steps between; each method one stage of it."""

    def __init__(self, cfg: Config, run: Run, start, data: dict | None = None) -> None:
        self.cfg, self.run, self.start = cfg, run, start  # start: the checkpoint a --resume continues from
        run_id = run.folder.run_id
        # what each checkpoint records of the run; data: the digests of its files a --resume has taken already
        record = identity.record(cfg, run_id, run.path, data) if cfg.checkpointing.enabled else None
        self.ckpt = CheckpointManager.for_config(cfg, run_id, record)
        self.config_yaml = dump_config(cfg)
        self.fleet: Fleet | None = None
        # the group replay buffer (grpo.replay), the run's across fleets: a checkpoint restores it with the weights
        self.replay = ReplayBuffer(cfg.grpo.replay, cfg.grpo.seed) if cfg.grpo.replay.enabled else None
        self.progress = Progress(replay=self.replay)  # the fleet of the moment's record (new_fleet makes a new one)
        self.rollouts_dir = None  # logger.save_rollouts: RUN_DIR/rollouts/, made by attach()
        self.timeline = self.bar = None
        self.status, self.error = "failed", None
        self.stop = StopSignals()
        self.restarts = RunRestarts(cfg, run.path, self.ckpt, run.ledger, self.new_fleet, self.replay)
        self.saved_step: int | None = None  # the latest checkpoint's step
        self.done = 0  # the last step finished
        # each process's peak memory, sampled from the fleet's start until it closes (summary.json's `memory`)
        self.memory = PeakMemory(lambda: self.fleet.local_roles() if self.fleet is not None else {})

    def new_fleet(self) -> Fleet:
        """A fleet of the run's Ray and ledger with a new Progress: an old fleet's refits and weights were its actors'."""
        self.progress = Progress(replay=self.replay)
        return Fleet(self.cfg, self.run.ray, self.run.ledger, self.progress)

    def open(self, saved) -> int:
        """Start the fleet (and Ray), restore a --resume's checkpoint, open the loggers; the first step to run."""
        cfg, run = self.cfg, self.run
        self.fleet = self.new_fleet()
        with self.stop.starting_up():  # a stop signal abandons the start at once: there is no step to finish
            self.fleet.start()
        self.memory.start()
        self.stop.install()  # again, should anything the start loaded have set a handler of its own
        if run.ray.started:
            self.stop.watch_ray()
        first = 1
        if self.start is not None:
            run.folder.resume_from(self.config_yaml, step_of(self.start))
            first = self.ckpt.load(self.fleet, self.start, saved, self.replay) + 1
            left = cfg.grpo.max_num_steps - first + 1
            print(f"resumed {run.path} from its checkpoint of step {first - 1}; "
                  + (f"steps {first}-{cfg.grpo.max_num_steps} to go" if left else "no steps left to run"),
                  file=sys.stderr, flush=True)
            self.saved_step = first - 1
        else:
            run.folder.begin(self.config_yaml)
        if cfg.logger.trace_max_events:  # the run's timeline, appended once a step (docs/trace.md)
            self.timeline = trace.TraceFile(run.path / "trace.json", cfg.logger.trace_max_events,
                                            resume=self.start is not None)
        self.attach(self.fleet)
        self.run.ledger.saved_at = time.perf_counter()
        fleet = self.fleet
        url = fleet.store_address()
        print(f"run folder {run.path}" + (f"; store {url} (dataplane-rl store ls {run.path})" if url else ""),
              file=sys.stderr, flush=True)
        run.open_loggers(cfg)  # after the start: a run refused before it touches nothing in the folder
        if cfg.grpo.val_at_start and first == 1 and not self.stop.requested:
            start_metrics = {"step": 0, **validation.validate(fleet, 0)}
            run.folder.log_validation(start_metrics)
            run.loggers.log(start_metrics, 0)
        self.bar = StepProgress(cfg.grpo.max_num_steps, enabled=cfg.logger.progress, initial=first - 1,
                                every=cfg.logger.log_every_n_steps)
        return first

    def attach(self, fleet: Fleet) -> None:
        """Wire a fleet to the run folder (again after an in-run resume: faults/restart.py)."""
        self.run.folder.record_store(fleet.store_address())
        if self.cfg.logger.save_rollouts:
            self.rollouts_dir = self.run.path / "rollouts"
            self.rollouts_dir.mkdir(exist_ok=True)
        fleet.record_actors(self.run.path)  # actors.json: each rollout actor's node and PID
        # async GRPO: the first steps generate now; a resumed run has its steps ahead back from the
        # checkpoint (checkpoint/ahead.py), so this sends none of them again
        fleet.rollouts.send_ahead(self.progress.version)

    def steps(self, first: int) -> None:
        """Steps `first`..grpo.max_num_steps, each trained, logged and checkpointed; a fault the run survives runs
        the step (or the steps since the last checkpoint) again."""
        step, last = first, self.cfg.grpo.max_num_steps
        self.done = first - 1  # the last step finished
        if self.stop.requested:  # a stop signal after the start: no step is under way, so none is begun
            return
        trained = None  # the step under way once grpo_step returned: [metrics, samples, logged]
        while step <= last:
            step_started = time.perf_counter()
            try:
                if trained is None:
                    with trace.span("step", step=step):
                        metrics, samples = grpo_step(self.fleet, self.progress, step, self.rollouts_dir)
                    check_finite(metrics)
                    trained = [metrics, samples, False]
                if not trained[2]:
                    self.log(step, trained[0], trained[1])
                    trained[2] = True
                self.checkpoint(step)
            except Exception as e:  # noqa: BLE001 - a dead train rank or store holder is survived; others raise
                step, trained = self.survive(e, step, step_started, trained)
                continue
            trained = None
            if self.timeline is not None:  # after the checkpoint: a kill leaves its span in the file
                self.timeline.write(trace.take())
            self.done = step
            if self.stop.requested and step < last:
                break
            step += 1

    def log(self, step: int, metrics: dict, samples: list) -> None:
        if validation.due(self.cfg.grpo, step):
            metrics.update(validation.validate(self.fleet, step))
        self.run.ledger.mark(metrics)
        self.run.folder.log_step(metrics, samples)
        self.run.loggers.log(metrics, step)
        self.bar.step_done(metrics)

    def checkpoint(self, step: int) -> None:
        c = self.cfg.checkpointing
        if c.enabled and (step % c.save_period == 0 or step == self.cfg.grpo.max_num_steps or self.stop.requested):
            self.ckpt.save(self.fleet, step, self.config_yaml, self.replay)
            self.saved_step, self.run.ledger.saved_at = step, time.perf_counter()

    def survive(self, e: Exception, step: int, step_started: float, trained) -> tuple[int, list | None]:
        """Recover from a step's failure (faults/restart.py), or raise the error the run stops with; the step to
        run next and what of it is done."""
        fleet, restarts = self.fleet, self.restarts
        if isinstance(e, RayLost) or ray_lost(self.stop, self.run):
            raise e  # Ray went with a signal to the whole group: nothing to ask it any more
        fault = restarts.classify(fleet, e)
        if fault is None:
            # a rank's death, told
            dead = train_rank_error(fleet, self.cfg.checkpointing, e, step, self.run.path, self.saved_step)
            if dead is None:
                raise e
            raise dead from None
        refused = restarts.refusal(fleet, self.progress, fault, step, self.saved_step, trained is not None)
        if refused is not None:
            raise refused from None
        if fault.what is FaultKind.STORE_HOLDER_DIED and restarts.can_regenerate(fleet, self.progress, trained is not None):
            # a step whose training is done goes on from where it was (validation, logging, saving)
            restarts.swap_store(fleet, fault, step, step_started, trained is not None)
            self.run.folder.record_store(fleet.store_address())
            return step, trained
        self.fleet, step = restarts.resume(fleet, fault, step, self.attach)
        self.bar.rewind(step - 1)
        return step, None

    def end(self) -> None:
        """The run's status; a completed run's policy exported."""
        fleet, last = self.fleet, self.cfg.grpo.max_num_steps
        if self.stop.requested and self.done < last:
            self.status, self.error = "interrupted", signal.Signals(self.stop.signum).name
            return
        if self.cfg.checkpointing.export_policy:
            export_hf(fleet.policy_state(), fleet.model_folder, self.run.path / "policy")
        self.status = "completed"

    def close(self) -> dict:
        """Close the loggers, the fleet and Ray, then write summary.json and release the folder; the summary."""
        run, fleet = self.run, self.fleet
        if self.bar is not None:
            self.bar.close()
        run.close_loggers()
        self.memory.stop()  # its last sample while the actors live
        try:
            if fleet is not None and self.replay is not None and not self.cfg.data_plane.keep_partitions:
                release(fleet.store, self.replay.pinned())  # the checkpoint holds their rows; a named store keeps none
            if fleet is not None:
                ray_lost(self.stop, run)  # a step that ended anyway: close() must not wait on a dead Ray either
                fleet.close()
        finally:
            try:
                run.ray.stop()
            finally:
                summary = self.finish()
        return summary

    def finish(self) -> dict:
        run, fleet = self.run, self.fleet
        try:
            # a second Ctrl-C here would cut summary.json or reward.png short (one landed inside matplotlib's
            # import and the run exited 1): held back until the folder is complete, then raised
            with deferred_sigint():
                summary = run.folder.finish(self.status, self.error, {
                    "run_dir": str(run.path), "signal": self.stop.signum, "nodes": fleet.nodes() if fleet else {},
                    "faults": run.ledger.faults, "store_url": fleet.store_address() if fleet else None,
                    "kept_store_url": fleet.kept_url() if fleet else None,
                    "memory": self.memory.summary() if self.memory.samples else None})
                if self.timeline is not None:  # the checkpoints' and the close's spans, the actors' last events
                    try:
                        self.timeline.close(trace.take())
                    except OSError as e:  # a full disk: the run's end is in summary.json; say what is missing
                        print(f"warning: {self.timeline.path} is missing the run's last events: {e.strerror or e}",
                              file=sys.stderr, flush=True)
        finally:
            run.folder.close()
        return summary
