"""The GRPO driver loop (DESIGN §2): one loop, two transports.

Data plane on: rollout actors and train workers read and write a shared store (shm, Mooncake, ...);
the driver reads only per-sample scalars. Data plane off: the driver holds the columns in an in-process
store and hands each worker its rows by reference. Both run this same code; only `self.store_url`
(None when off) and the `_call` helper differ.
"""

from __future__ import annotations

import contextlib
import math
import logging
import os
import signal
import sys
import time
from dataclasses import dataclass, field

import numpy as np
import pyarrow as pa

from dataplane_rl.algorithms.grpo import advantages, informative_groups
from dataplane_rl.config import Config, dump_config
from dataplane_rl.errors import ConfigError, DataPlaneError
from dataplane_rl.rollout.worker import RolloutJob, RolloutWorker
from dataplane_rl.schema import load_schema
from dataplane_rl.store import MemoryStore, open_store, to_numpy
from dataplane_rl.tasks import get_task
from dataplane_rl.train import validation
from dataplane_rl.train.batch import RowSet, fetch, rowset_size, select, shard_balanced, write
from dataplane_rl.train.checkpoint import CheckpointManager, step_of
from dataplane_rl.train.export import export_hf
from dataplane_rl.train.loggers import MetricLoggers
from dataplane_rl.train.model import resolve_model
from dataplane_rl.train.preempt import StopSignals
from dataplane_rl.train.reaper import deferred_sigint
from dataplane_rl.train.run_dir import RunDir
from dataplane_rl.train.worker import TrainWorker


class DynamicSamplingError(DataPlaneError):
    """Dynamic sampling could not collect enough informative groups."""


@dataclass
class StepIO:
    """Data-plane traffic of one step."""

    bytes_written: int = 0
    bytes_read: int = 0
    put_s: float = 0.0
    get_s: float = 0.0
    driver_bytes_read: int = 0
    timing: dict = field(default_factory=dict)

    def add(self, receipt: dict) -> None:
        self.bytes_written += int(receipt.get("bytes_written", 0))
        self.bytes_read += int(receipt.get("bytes_read", 0))
        self.put_s += float(receipt.get("put_s", 0.0))
        self.get_s += float(receipt.get("get_s", 0.0))


def open_run_store(cfg: Config):
    """The step store: the configured backend when the data plane is on, else the driver's own memory."""
    if not cfg.data_plane.enabled:
        return MemoryStore("driver")
    url = cfg.data_plane.backend
    if url.startswith("mooncake://"):
        return open_store(url, config=cfg.data_plane.mooncake)
    return open_store(url)


def quiet_ray_token_warning() -> None:
    """Ray 2.60 logs a warning about token authentication on every ray.init() unless RAY_AUTH_MODE is set;
    it says nothing about this run (a user who sets RAY_AUTH_MODE=token asked for it, and gets no warning
    either). Errors of that module still show."""
    logging.getLogger("ray._private.authentication.authentication_token_setup").setLevel(logging.ERROR)
def preflight(cfg: Config):
    """Every check that needs no Ray, made before Ray starts, so a mistake is one clear ConfigError and not
    an actor's traceback: the task and its file, the model folder, the engine. Returns (task, model folder)."""
    task = get_task(cfg.task.name, cfg.task.path)
    folder = resolve_model(cfg.policy.model, cfg.grpo.seed, cfg.policy.model_cache_dir)
    if cfg.generation.backend == "vllm":
        from dataplane_rl.rollout.vllm_engine import require_vllm

        require_vllm()
    return task, str(folder)


class GRPOTrainer:
    def __init__(self, cfg: Config) -> None:
        self.cfg = cfg
        self.schema = load_schema(cfg.data_plane.schema_name)
        self.task, self.model_folder = preflight(cfg)
        validation.check_task(cfg.grpo, self.task)
        self.store = None
        self.store_url: str | None = None
        self.rollout: list = []
        self.workers: list = []
        self.policy_ref = None  # the last refit's full state dict, in the object store
        self._groups: list = []  # placement groups: rollout, train
        self.nodes: dict[str, list[str]] = {}  # node IP per rollout actor and per train rank
        self._ray_started = False
        self.kept_store_url: str | None = None

    # -- lifecycle ----------------------------------------------------------------------------------
    def start(self) -> None:
        import ray

        from dataplane_rl.train import placement

        cfg = self.cfg
        placement.check_store_reachable(cfg)  # before Ray: a wrong address fails in seconds
        if not ray.is_initialized():
            quiet_ray_token_warning()
            # set first: a Ctrl-C inside ray.init must still shut down what it started (close())
            self._ray_started = True
            # address="local": without it ray.init() joins whatever /tmp/ray/ray_current_cluster names,
            # even a dead `ray start` head, instead of starting this run's own instance
            ray.init(address=cfg.cluster.address or "local", num_cpus=cfg.cluster.num_cpus if not cfg.cluster.address else None,
                     include_dashboard=False, logging_level="WARNING", log_to_driver=True)
        ray_nodes = placement.alive_nodes()
        placement.check_backend_spans(cfg, ray_nodes)
        self.store = open_run_store(cfg)
        self.store_url = self.store.url if cfg.data_plane.enabled else None
        if cfg.data_plane.keep_partitions:
            if hasattr(self.store, "keep"):
                self.store.keep()  # an auto-made shm:// folder must outlive the run, or nothing is kept
            self.kept_store_url = self.store_url
            print(f"data_plane.keep_partitions: every step's partition stays in {self.store_url}\n"
                  f"  inspect: dataplane-rl store ls {self.store_url}   free: dataplane-rl store drop "
                  f"{self.store_url} --all", file=sys.stderr)
        cfg_dict = cfg.model_dump(mode="json", by_alias=True)
        cpus = os.cpu_count() or 1
        gen_threads = max(1, cpus // cfg.generation.num_workers)
        train_threads = max(1, cpus // cfg.policy.dp_size)
        N, D = cfg.generation.num_workers, cfg.policy.dp_size
        rollout_gpus, train_gpus = placement.gpu_plan(cfg)
        self._groups = [placement.placement_group("rollout", N, rollout_gpus, cfg, ray_nodes),
                        placement.placement_group("train", D, train_gpus, cfg, ray_nodes)]
        Rollout, Train = ray.remote(RolloutWorker), ray.remote(TrainWorker)
        self.rollout = [Rollout.options(**placement.options(self._groups[0], i, rollout_gpus)).remote(
            cfg_dict, self.model_folder, self.store_url, gen_threads) for i in range(N)]
        self.workers = [Train.options(**placement.options(self._groups[1], r, train_gpus)).remote(
            cfg_dict, self.model_folder, self.store_url, r, D, train_threads) for r in range(D)]
        self.nodes = {"rollout": placement.node_ips(self.rollout), "train": placement.node_ips(self.workers)}
        placement.pin_gloo_interfaces(self.workers)
        init_method = ray.get(self.workers[0].address.remote())  # rank 0's node IP
        ray.get([w.init_dist.remote(init_method) for w in self.workers] + [a.ready.remote() for a in self.rollout])

    def close(self) -> None:
        """Stop actors, the store and Ray, each even if an earlier one fails; a Ctrl-C meanwhile waits."""
        import ray

        with deferred_sigint():
            try:
                for actor in self.rollout + self.workers:
                    try:
                        ray.get(actor.close.remote(), timeout=30)
                    except Exception:  # the actor may already be dead; the kill below is what matters
                        pass
                    with contextlib.suppress(Exception):
                        ray.kill(actor)
            finally:
                self.rollout, self.workers = [], []
                for pg in self._groups:
                    with contextlib.suppress(Exception):  # gone with a dead cluster
                        ray.util.remove_placement_group(pg)
                self._groups = []
                try:
                    if self.store is not None:
                        self.store.close()
                        self.store = None
                finally:
                    if self._ray_started:
                        ray.shutdown()
                        self._ray_started = False

    def refit(self) -> float:
        """Hand the policy's full weights to the rollout actors, gathered once (rank 0's copy), as one
        object-store reference every actor reads; returns the slowest engine's load seconds."""
        import ray

        refs = [w.state_dict.remote() for w in self.workers]  # collective; ranks > 0 return {}
        ray.get(refs[1:])
        self.policy_ref = refs[0]
        return max(ray.get([a.load_weights.remote(self.policy_ref) for a in self.rollout]))

    # -- one step -----------------------------------------------------------------------------------
    def _call(self, method: str, jobs: list[RowSet], fields) -> list:
        """Run `method` on every train worker with its row set. Data plane on: workers use the store.
        Off: the driver fetches the inputs from its own store, and writes back what workers return."""
        import ray

        if self.store_url:
            return ray.get([getattr(w, method).remote(rs) for w, rs in zip(self.workers, jobs)])
        tables = [fetch(self.store, rs, fields) for rs in jobs]
        outs = ray.get([getattr(w, method).remote(rs, t) for w, rs, t in zip(self.workers, jobs, tables)])
        for rs, out in zip(jobs, outs):
            write(self.store, rs, out)
        return outs

    def rollout_round(self, pid: str, step: int, round_: int, prompts: list[str], G: int, io: StepIO | None = None,
                      group_offset: int = 0, validation: bool = False) -> list[dict]:
        """Create partition `pid`, have the rollout actors fill it with G samples per prompt; the receipts."""
        import ray

        self.store.create_partition(pid, self.schema, len(prompts) * G)
        splits = np.array_split(np.arange(len(prompts)), len(self.rollout))
        jobs = [RolloutJob(pid, step, round_, int(s[0]) * G, (s + group_offset).tolist(), [prompts[i] for i in s],
                           validation=validation) for s in splits if s.size]
        results = ray.get([a.generate.remote(j) for a, j in zip(self.rollout, jobs)])
        for job, (table, receipt) in zip(jobs, results):
            if io is not None:
                io.add(receipt)
            if table is not None:  # data plane off: the driver holds the columns
                write(self.store, [(pid, np.arange(job.row_start, job.row_start + table.num_rows))], table)
        return [r for _, r in results]

    def generate_round(self, step: int, round_: int, io: StepIO) -> tuple[str, pa.Table]:
        cfg = self.cfg
        P, G = cfg.grpo.num_prompts_per_step, cfg.grpo.num_generations_per_prompt
        pid = f"step-{step:06d}" if round_ == 0 else f"step-{step:06d}-r{round_}"
        receipts = self.rollout_round(pid, step, round_, self.task.prompts(cfg.grpo.seed, step, round_, P), G, io)
        io.timing["generate"] = io.timing.get("generate", 0.0) + max(r["generate_s"] for r in receipts)
        t0 = time.perf_counter()
        scalars = self.store.get(pid, self.schema.field_set("DRIVER_FIELDS"))
        io.get_s += time.perf_counter() - t0
        io.driver_bytes_read += scalars.nbytes
        return pid, scalars

    def step(self, step: int) -> tuple[dict, list[dict]]:
        import ray

        cfg, g = self.cfg, self.cfg.grpo
        io = StepIO()
        t_step = time.perf_counter()
        P = g.num_prompts_per_step
        rounds_rewards, kept = [], []  # kept: (pid, rows of one whole group)
        scalars: dict[str, pa.Table] = {}  # per round partition: its DRIVER_FIELDS, read once
        for round_ in range(g.max_gen_batches if g.use_dynamic_sampling else 1):
            pid, sc = self.generate_round(step, round_, io)
            scalars[pid] = sc
            rewards = to_numpy(sc.column("total_reward")).astype(np.float64)
            groups = to_numpy(sc.column("group_id"))
            rounds_rewards.append(rewards)
            keep = informative_groups(rewards, groups) if g.use_dynamic_sampling else np.unique(groups)
            for gid in keep:
                if len(kept) < P:
                    kept.append((pid, np.flatnonzero(groups == gid)))
            if len(kept) >= P:
                break
        pids = list(scalars)
        if len(kept) < P:
            self._drop(pids)
            raise DynamicSamplingError(
                f"step {step}: dynamic sampling kept {len(kept)} of {P} groups with non-equal rewards after "
                f"{len(pids)} rounds (grpo.max_gen_batches={g.max_gen_batches}); raise grpo.max_gen_batches, "
                "lower grpo.num_prompts_per_step, or turn grpo.use_dynamic_sampling off")
        rs = _merge([[k] for k in kept])  # the kept rows, whole groups in order, by partition
        sc = pa.concat_tables([scalars[pid].take(pa.array(rows)) for pid, rows in rs])
        rewards = to_numpy(sc.column("total_reward")).astype(np.float64)
        groups = to_numpy(sc.column("group_id"))
        # group ids repeat across rounds: make them unique per (round partition, group)
        seg = np.concatenate([np.full(len(rows), i) for i, (_, rows) in enumerate(rs)])
        unique_groups = seg * (P + 1) + groups
        adv = advantages(rewards, unique_groups, normalize=g.normalize_rewards, leave_one_out=g.use_leave_one_out_baseline)
        truncated = to_numpy(sc.column("truncated")).astype(bool)
        sample_mask = np.where(truncated & g.overlong_filtering, 0, 1).astype(np.int8)
        t0 = time.perf_counter()
        io.bytes_written += write(self.store, rs, pa.table({"advantages": pa.array(adv), "sample_mask": pa.array(sample_mask)}))
        io.put_s += time.perf_counter() - t0

        # shard: global batches in row-set order, each split over ranks balanced by tokens
        lengths = to_numpy(sc.column("input_lengths")).astype(np.int64)
        n, GB, D = rowset_size(rs), cfg.policy.train_global_batch_size, cfg.policy.dp_size
        per_rank_steps: list[list[RowSet]] = [[] for _ in range(D)]
        for start in range(0, n, GB):
            pos = np.arange(start, min(start + GB, n))
            for r, shard in enumerate(shard_balanced(lengths[pos], D)):
                per_rank_steps[r].append(select(rs, pos[shard]))
        per_rank_all = [_merge(steps) for steps in per_rank_steps]

        t0 = time.perf_counter()
        self._call("logprobs", per_rank_all, self.schema.field_set("LOGPROB_SEED_FIELDS"))
        io.timing["logprobs"] = time.perf_counter() - t0
        t0 = time.perf_counter()
        fields = self.cfg.train_fields(self.schema)
        if self.store_url:
            results = ray.get([w.train.remote(steps) for w, steps in zip(self.workers, per_rank_steps)])
        else:
            tables = [[fetch(self.store, s, fields) for s in steps] for steps in per_rank_steps]
            results = ray.get([w.train.remote(steps, t) for w, steps, t in zip(self.workers, per_rank_steps, tables)])
        io.timing["train"] = time.perf_counter() - t0
        for receipt in ray.get([w.take_io.remote() for w in self.workers]):
            io.add(receipt)
        t0 = time.perf_counter()
        io.timing["refit_engine"] = self.refit()
        io.timing["refit"] = time.perf_counter() - t0

        t0 = time.perf_counter()
        data = fetch(self.store, rs, self.schema.field_set("TRAIN_DATA_FIELDS"))
        io.driver_bytes_read += data.nbytes
        io.get_s += time.perf_counter() - t0
        samples = [{"sample_id": f"{pid}/{int(row)}", "group_id": int(gid), "prompt": pr, "response": resp,
                    "total_reward": float(rw), "advantage": float(a), "sample_mask": int(m)}
                   for (pid, row), gid, pr, resp, rw, a, m in zip(
                       ((pid, row) for pid, rows in rs for row in rows), data.column("group_id").to_pylist(),
                       data.column("prompt_text").to_pylist(), data.column("response_text").to_pylist(),
                       data.column("total_reward").to_pylist(), data.column("advantages").to_pylist(),
                       data.column("sample_mask").to_pylist())]
        if not cfg.data_plane.keep_partitions:
            self._drop(pids)
        io.timing["step"] = time.perf_counter() - t_step
        return self._metrics(step, results[0], rounds_rewards, rewards, len(pids), io), samples

    def _drop(self, pids: list[str]) -> None:
        for pid in pids:
            self.store.drop_partition(pid)

    def _metrics(self, step, train, rounds_rewards, kept_rewards, rounds, io: StepIO) -> dict:
        m = {"step": step}
        for k in ("loss", "pg_loss", "kl_penalty", "positive_nll_loss", "clip_fraction", "dual_clip_fraction",
                  "probs_ratio_mean", "approx_entropy", "entropy", "grad_norm", "global_valid_toks", "logprob_mismatch",
                  "lr", "param_norm"):
            m[f"train/{k}"] = train[k]
        m["train/reward"] = float(np.mean(np.concatenate(rounds_rewards)))
        m["train/filtered_reward"] = float(np.mean(kept_rewards))
        m["train/generation_rounds"] = rounds
        m["train/optimizer_steps"] = train["optimizer_steps"]
        m["data_plane/enabled"] = bool(self.store_url)
        m["data_plane/bytes_written"] = io.bytes_written
        m["data_plane/bytes_read"] = io.bytes_read
        m["data_plane/put_seconds"] = io.put_s
        m["data_plane/get_seconds"] = io.get_s
        m["data_plane/seconds"] = io.put_s + io.get_s
        m["data_plane/driver_bytes_read"] = io.driver_bytes_read
        for k, v in io.timing.items():
            m[f"timing/{k}"] = v
        return m


def _merge(steps: list[RowSet]) -> RowSet:
    out: RowSet = []
    for rs in steps:
        for pid, rows in rs:
            if out and out[-1][0] == pid:
                out[-1] = (pid, np.concatenate([out[-1][1], rows]))
            else:
                out.append((pid, rows))
    return out


class StepProgress:
    """The console bar: it advances when a step ends, showing that step's numbers (never step k's at k-1/N)."""

    def __init__(self, total: int, enabled: bool = True, file=None, mininterval: float = 0.1, initial: int = 0) -> None:
        from tqdm import tqdm

        # initial: steps already done (a resumed run starts its bar there)
        self.bar = tqdm(total=total, initial=initial, desc="grpo", unit="step", disable=not enabled,
                        dynamic_ncols=True, file=file, mininterval=mininterval)

    def step_done(self, metrics: dict) -> None:
        self.bar.set_postfix(reward=f"{metrics['train/reward']:.3f}", loss=f"{metrics['train/loss']:.4f}",
                             step_s=f"{metrics['timing/step']:.1f}", refresh=False)
        self.bar.update(1)

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


def train(cfg: Config, resume: bool = False) -> dict:
    """Run GRPO as configured; returns the summary. The run folder is consistent however it ends: a run
    refused its folder (held by a live run, or holding a finished one) touches nothing there; any other
    failure, before or after the start, leaves a summary.json saying so.

    resume: continue the run in cfg.logger.run_dir from its latest complete checkpoint.
    SIGTERM/SIGINT end the current step, checkpoint (when checkpointing is on) and return status
    'interrupted' with the signal's number in summary["signal"].
    """
    import ray

    start = None
    if resume:  # refused before the folder is opened, so a refusal leaves the run's summary as it was
        start = CheckpointManager.for_config(cfg).find()
        if step_of(start) > cfg.grpo.max_num_steps:
            raise ConfigError(f"--resume: the latest checkpoint is step {step_of(start)}, past grpo.max_num_steps="
                              f"{cfg.grpo.max_num_steps}; raise grpo.max_num_steps to continue the run")
    run = RunDir(cfg.logger.run_dir, overwrite=cfg.logger.overwrite, resume=resume)
    if cfg.logger.run_dir is None:  # the fresh runs/<time> folder: record it, so --resume and the checkpoints find it
        cfg = cfg.model_copy(deep=True)
        cfg.logger.run_dir = str(run.path)
    ckpt = CheckpointManager.for_config(cfg)
    config_yaml = dump_config(cfg)
    trainer = loggers = None
    status, error, bar = "failed", None, None
    stop = StopSignals()
    try:
        with stop:
            trainer = GRPOTrainer(cfg)
            trainer.start()
            stop.install()  # ray.init replaced the SIGTERM handler
            first = 1
            if start is not None:
                run.resume_from(config_yaml, step_of(start))
                first = ckpt.load(trainer, start) + 1
                trainer.refit()
            else:
                run.begin(config_yaml)
            # after the start: a run refused before it touches nothing in the folder
            loggers = MetricLoggers(cfg.logger, run.path, cfg.model_dump(mode="json", by_alias=True))
            if cfg.grpo.val_at_start and first == 1:
                start_metrics = {"step": 0, **validation.validate(trainer, 0)}
                run.log_validation(start_metrics)
                loggers.log(start_metrics, 0)
            last = cfg.grpo.max_num_steps
            bar = StepProgress(last, enabled=cfg.logger.progress, initial=first - 1)
            done = first - 1  # the last step finished
            for step in range(first, last + 1):
                metrics, samples = trainer.step(step)
                check_finite(metrics)
                if validation.due(cfg.grpo, step):
                    metrics.update(validation.validate(trainer, step))
                run.log_step(metrics, samples)
                loggers.log(metrics, step)
                bar.step_done(metrics)
                if cfg.checkpointing.enabled and (step % cfg.checkpointing.save_period == 0 or step == last
                                                  or stop.requested):
                    ckpt.save(trainer, step, config_yaml)
                done = step
                if stop.requested and step < last:
                    break
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
        error = f"{type(e).__name__}: {e}"
        raise
    finally:
        if bar is not None:
            bar.close()
        if loggers is not None:
            loggers.close()
        try:
            if trainer is not None:
                trainer.close()
        finally:
            try:
                summary = run.finish(status, error, {"run_dir": str(run.path), "signal": stop.signum,
                                                     "nodes": trainer.nodes if trainer else {},
                                                     "store_url": trainer.store_url if trainer else None,
                                                     "kept_store_url": trainer.kept_store_url if trainer else None})
            finally:
                run.close()
    return summary
