"""The GRPO run (docs/architecture.md §4): the run folder, checkpoints, signals and the step loop around GRPOTrainer.

One loop for every mode: the data plane on or off (driver/transport.py), sync or async GRPO
(driver/rollouts.py); the step's phases are GRPOTrainer's (driver/trainer.py).
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
from dataplane_rl.checkpoint.manager import CheckpointManager, step_of
from dataplane_rl.checkpoint.export import export_hf
from dataplane_rl.run.loggers import MetricLoggers
from dataplane_rl.run.reaper import deferred_sigint
from dataplane_rl.run.preempt import LOST, TERMINATING, RayLost, StopSignals
from dataplane_rl.driver.rollouts import RolloutActorError, RolloutWaitError
from dataplane_rl.run.folder import RunDir
from dataplane_rl.driver.step_io import DynamicSamplingError
from dataplane_rl.driver.trainer import GRPOTrainer
from dataplane_rl.driver.preflight import open_run_store, preflight
from dataplane_rl.driver.train_faults import train_rank_error
from dataplane_rl.driver.restart import RunRestarts

__all__ = ["DynamicSamplingError", "GRPOTrainer", "NonFiniteError", "RolloutActorError", "RolloutWaitError", "StepProgress", "check_finite",
           "open_run_store", "preflight", "train"]


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
        """Back to `done` steps (an in-run resume from the checkpoint of step `done`: driver/restart.py)."""
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


def ray_lost(stop: StopSignals, trainer) -> bool:
    """After a SIGTERM: whether Ray's processes went with it (a signal to the whole process group); if so,
    neither the handler nor close() may wait on Ray any more."""
    if stop.ray_lost or (stop.signum in TERMINATING and stop.ray_going()):
        stop.ray_lost = True
        LOST.set()
        if trainer is not None:
            trainer.ray_lost = True
    return stop.ray_lost


def train(cfg: Config, resume: bool = False) -> dict:
    """Run GRPO as configured; returns the summary. The run folder is consistent however it ends: a run
    refused its folder (held by a live run, or holding a finished one) touches nothing there; any other
    failure, before or after the start, leaves a summary.json saying so.

    resume: continue the run in cfg.logger.run_dir from its latest complete checkpoint.
    SIGTERM/SIGHUP/SIGINT end the current step, checkpoint (when checkpointing is on) and return status
    'interrupted' with the signal's number in summary["signal"].
    """
    import ray

    start = saved = None
    if resume:  # refused before the folder is opened, so a refusal leaves the run's summary as it was
        start = CheckpointManager.for_config(cfg).find()  # its bytes verified against its manifest
        if step_of(start) > cfg.grpo.max_num_steps:
            raise ConfigError(f"--resume: the latest checkpoint is step {step_of(start)}, past grpo.max_num_steps="
                              f"{cfg.grpo.max_num_steps}; raise grpo.max_num_steps to continue the run")
        saved = CheckpointManager.for_config(cfg).check(start)  # every file parsed, no code run, before Ray
    run = RunDir(cfg.logger.run_dir, overwrite=cfg.logger.overwrite, resume=resume)
    if cfg.logger.run_dir is None:  # the fresh runs/<time> folder: record it, so --resume and the checkpoints find it
        cfg = cfg.model_copy(deep=True)
        cfg.logger.run_dir = str(run.path)
    ckpt = CheckpointManager.for_config(cfg)
    config_yaml = dump_config(cfg)
    trainer = loggers = timeline = None
    status, error, bar = "failed", None, None
    stop = StopSignals()
    try:
        with stop:
            trainer = GRPOTrainer(cfg)
            trainer.start()
            stop.install()  # ray.init replaced the SIGTERM handler
            if trainer._ray_started:
                stop.watch_ray()
            first = 1
            if start is not None:
                run.resume_from(config_yaml, step_of(start))
                first = ckpt.load(trainer, start, saved) + 1
                left = cfg.grpo.max_num_steps - first + 1
                print(f"resumed {run.path} from its checkpoint of step {first - 1}; "
                      + (f"steps {first}-{cfg.grpo.max_num_steps} to go" if left else "no steps left to run"),
                      file=sys.stderr, flush=True)
            else:
                run.begin(config_yaml)
            if cfg.logger.trace_max_events:  # the run's timeline, appended once a step (docs/trace.md)
                timeline = trace.TraceFile(run.path / "trace.json", cfg.logger.trace_max_events, resume=start is not None)

            def attach(t) -> None:
                """Wire a trainer to the run folder (again after an in-run resume: driver/restart.py)."""
                run.record_store(t.store_url)
                if cfg.logger.save_rollouts:
                    t.rollouts_dir = run.path / "rollouts"
                    t.rollouts_dir.mkdir(exist_ok=True)
                t.recovery.record(run.path)  # actors.json: each rollout actor's node and PID
                # async GRPO: the first steps generate now; a resumed run has its steps ahead back from the
                # checkpoint (checkpoint/ahead.py), so this sends none of them again
                t.rollouts.send_ahead(t.version)

            attach(trainer)
            restarts = RunRestarts(cfg, run.path, ckpt)
            print(f"run folder {run.path}" + (f"; store {trainer.store_url} (dataplane-rl store ls {run.path})"
                                              if trainer.store_url else ""), file=sys.stderr, flush=True)
            # after the start: a run refused before it touches nothing in the folder
            loggers = MetricLoggers(cfg.logger, run.path, cfg.model_dump(mode="json", by_alias=True))
            if cfg.grpo.val_at_start and first == 1:
                start_metrics = {"step": 0, **validation.validate(trainer, 0)}
                run.log_validation(start_metrics)
                loggers.log(start_metrics, 0)
            last = cfg.grpo.max_num_steps
            bar = StepProgress(last, enabled=cfg.logger.progress, initial=first - 1, every=cfg.logger.log_every_n_steps)
            done = first - 1  # the last step finished
            saved_step = first - 1 if start is not None else None  # the latest checkpoint's step
            step = first
            trained = None  # the step under way once trainer.step returned: [metrics, samples, logged]
            while step <= last:
                step_started = time.perf_counter()
                try:
                    if trained is None:
                        with trace.span("step", step=step):
                            metrics, samples = trainer.step(step)
                        check_finite(metrics)
                        trained = [metrics, samples, False]
                    metrics, samples, logged = trained
                    if not logged:
                        if validation.due(cfg.grpo, step):
                            metrics.update(validation.validate(trainer, step))
                        restarts.mark(metrics)
                        run.log_step(metrics, samples)
                        loggers.log(metrics, step)
                        bar.step_done(metrics)
                        trained[2] = True
                    if cfg.checkpointing.enabled and (step % cfg.checkpointing.save_period == 0 or step == last
                                                      or stop.requested):
                        ckpt.save(trainer, step, config_yaml)
                        saved_step, restarts.saved_at = step, time.perf_counter()
                except Exception as e:  # noqa: BLE001 - a dead train rank or store holder is survived; others raise
                    if isinstance(e, RayLost) or ray_lost(stop, trainer):
                        raise  # Ray went with a signal to the whole group: nothing to ask it any more
                    fault = restarts.classify(trainer, e)
                    if fault is None:
                        dead = train_rank_error(trainer, e, step, run.path, saved_step)  # a rank's death, told
                        if dead is None:
                            raise
                        raise dead from None
                    refused = restarts.refusal(trainer, fault, step, saved_step, trained is not None)
                    if refused is not None:
                        raise refused from None
                    if fault.what == "store holder died" and restarts.can_regenerate(trainer, trained is not None):
                        # a step whose training is done goes on from where it was (validation, logging, saving)
                        restarts.swap_store(trainer, fault, step, step_started, trained is not None)
                        run.record_store(trainer.store_url)
                    else:
                        trainer, step = restarts.resume(trainer, fault, step, attach)
                        trained = None
                        bar.rewind(step - 1)
                    continue
                trained = None
                if timeline is not None:  # after the checkpoint: a kill leaves its span in the file
                    timeline.write(trace.take())
                done = step
                if stop.requested and step < last:
                    break
                step += 1
            if stop.requested and done < last:
                status, error = "interrupted", signal.Signals(stop.signum).name
            else:
                if trainer.policy_ref is None:
                    trainer.refit()
                export_hf(ray.get(trainer.policy_ref), trainer.model_folder, run.path / "policy")
                status = "completed"
    except KeyboardInterrupt:
        status, error = "interrupted", "KeyboardInterrupt"
        raise
    except BaseException as e:
        # a SIGTERM to the whole process group stopped Ray too: RayLost, or an actor's death seen first.
        # Stop now, without waiting on Ray, as the interrupted run it is (exit 143 all the same)
        if isinstance(e, RayLost) or ray_lost(stop, trainer):
            sent = signal.Signals(stop.signum).name if stop.signum else "SIGTERM"
            status, error = "interrupted", f"{sent} to the process group: Ray's processes stopped with the driver"
        else:
            error = run.record_error(e)
            raise
    finally:
        if bar is not None:
            bar.close()
        if loggers is not None:
            loggers.close()
        try:
            if trainer is not None:
                ray_lost(stop, trainer)  # a step that ended anyway: close() must not wait on a dead Ray either
                trainer.close()
        finally:
            try:
                # a second Ctrl-C here would cut summary.json or reward.png short (one landed inside matplotlib's
                # import and the run exited 1): held back until the folder is complete, then raised
                with deferred_sigint():
                    summary = run.finish(status, error, {"run_dir": str(run.path), "signal": stop.signum,
                                                         "nodes": trainer.nodes if trainer else {},
                                                         "faults": trainer.recovery.faults if trainer else [],
                                                         "store_url": trainer.store_url if trainer else None,
                                                         "kept_store_url": trainer.kept_store_url if trainer else None})
                    if timeline is not None:  # the checkpoints' and the close's spans, the actors' last events
                        try:
                            timeline.close(trace.take())
                        except OSError as e:  # a full disk: the run's end is in summary.json; say what is missing
                            print(f"warning: {timeline.path} is missing the run's last events: {e.strerror or e}",
                                  file=sys.stderr, flush=True)
            finally:
                run.close()
    return summary
