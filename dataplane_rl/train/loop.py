"""The GRPO driver loop (DESIGN §2): one loop, two transports.

Data plane on: rollout actors and train workers read and write a shared store (shm, Mooncake, ...);
the driver reads only per-sample scalars. Data plane off: the driver holds the columns in an in-process
store and hands each worker its rows by reference. Both run this same code; only `self.store_url`
(None when off) and the `_call` helper differ.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass, field

import numpy as np
import pyarrow as pa

from dataplane_rl.algorithms.grpo import advantages, informative_groups
from dataplane_rl.config import Config, dump_config
from dataplane_rl.errors import DataPlaneError
from dataplane_rl.rollout.worker import RolloutJob, RolloutWorker
from dataplane_rl.schema import load_schema
from dataplane_rl.store import MemoryStore, open_store, to_numpy
from dataplane_rl.tasks import get_task
from dataplane_rl.train import validation
from dataplane_rl.train.batch import RowSet, fetch, rowset_size, select, shard_balanced, write
from dataplane_rl.train.loggers import MetricLoggers
from dataplane_rl.train.model import resolve_model
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


class GRPOTrainer:
    def __init__(self, cfg: Config) -> None:
        self.cfg = cfg
        self.schema = load_schema(cfg.data_plane.schema_name)
        self.task = get_task(cfg.task.name, cfg.task.path)
        validation.check_task(cfg.grpo, self.task)
        self.model_folder = str(resolve_model(cfg.policy.model, cfg.grpo.seed, cfg.policy.model_cache_dir))
        self.store = None
        self.store_url: str | None = None
        self.rollout: list = []
        self.workers: list = []
        self._ray_started = False

    # -- lifecycle ----------------------------------------------------------------------------------
    def start(self) -> None:
        import ray

        cfg = self.cfg
        if not ray.is_initialized():
            # address="local": without it ray.init() joins whatever /tmp/ray/ray_current_cluster names,
            # even a dead `ray start` head, instead of starting this run's own instance
            ray.init(address=cfg.cluster.address or "local", num_cpus=cfg.cluster.num_cpus if not cfg.cluster.address else None,
                     include_dashboard=False, logging_level="WARNING", log_to_driver=True)
            self._ray_started = True
        self.store = open_run_store(cfg)
        self.store_url = self.store.url if cfg.data_plane.enabled else None
        cfg_dict = cfg.model_dump(mode="json", by_alias=True)
        cpus = os.cpu_count() or 1
        gen_threads = max(1, cpus // cfg.generation.num_workers)
        train_threads = max(1, cpus // cfg.policy.dp_size)
        # num_cpus=0: the phases run one after another, so actors share the cores instead of reserving them
        Rollout = ray.remote(num_cpus=0)(RolloutWorker)
        gpus = 1 if cfg.policy.device != "cpu" and ray.cluster_resources().get("GPU", 0) >= cfg.policy.dp_size else 0
        Train = ray.remote(num_cpus=0, num_gpus=gpus)(TrainWorker)
        self.rollout = [Rollout.remote(cfg_dict, self.model_folder, self.store_url, gen_threads)
                        for _ in range(cfg.generation.num_workers)]
        D = cfg.policy.dp_size
        self.workers = [Train.remote(cfg_dict, self.model_folder, self.store_url, r, D, train_threads) for r in range(D)]
        init_method = ray.get(self.workers[0].address.remote())
        ray.get([w.init_dist.remote(init_method) for w in self.workers] + [a.ready.remote() for a in self.rollout])

    def close(self) -> None:
        import ray

        for actor in self.rollout + self.workers:
            try:
                ray.get(actor.close.remote(), timeout=30)
            except Exception:  # the actor may already be dead; the kill below is what matters
                pass
            ray.kill(actor)
        self.rollout, self.workers = [], []
        if self.store is not None:
            self.store.close()
            self.store = None
        if self._ray_started:
            ray.shutdown()
            self._ray_started = False

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
        state = ray.put(ray.get(self.workers[0].state_dict.remote()))
        engine_s = ray.get([a.load_weights.remote(state) for a in self.rollout])
        io.timing["refit_engine"] = max(engine_s)
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
                  "probs_ratio_mean", "approx_entropy", "grad_norm", "global_valid_toks", "logprob_mismatch"):
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


def train(cfg: Config) -> dict:
    """Run GRPO as configured; returns the summary. The run folder is consistent however it ends."""
    run = RunDir(cfg.logger.run_dir, dump_config(cfg))
    trainer = GRPOTrainer(cfg)
    status, error = "failed", None
    bar = loggers = None
    try:
        trainer.start()
        # after the start: a run refused before it touches nothing in the folder
        loggers = MetricLoggers(cfg.logger, run.path, cfg.model_dump(mode="json", by_alias=True))
        from tqdm import tqdm

        if cfg.grpo.val_at_start:
            start_metrics = {"step": 0, **validation.validate(trainer, 0)}
            run.log_validation(start_metrics)
            loggers.log(start_metrics, 0)
        bar = tqdm(range(1, cfg.grpo.max_num_steps + 1), desc="grpo", unit="step", disable=not cfg.logger.progress,
                   dynamic_ncols=True)
        for step in bar:
            metrics, samples = trainer.step(step)
            if validation.due(cfg.grpo, step):
                metrics.update(validation.validate(trainer, step))
            run.log_step(metrics, samples)
            loggers.log(metrics, step)
            bar.set_postfix(reward=f"{metrics['train/reward']:.3f}", loss=f"{metrics['train/loss']:.4f}",
                            step_s=f"{metrics['timing/step']:.1f}")
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
            trainer.close()
        finally:
            summary = run.finish(status, error, {"run_dir": str(run.path), "store_url": trainer.store_url})
    return summary
