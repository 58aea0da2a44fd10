"""The GRPO driver (docs/architecture.md §4): actors, the step store, and one training step as named phases.

Sync and async GRPO run the same phases; they differ only in where `collect_groups` finds a step's rollout
partition (generated on demand, or sent ahead: driver/rollouts.py) and in whether `refit` waits for the
rollout actors. The data plane on/off switch is driver/transport.py.
"""

from __future__ import annotations

import contextlib
import os
import sys
import time
from pathlib import Path

import numpy as np
import pyarrow as pa

from dataplane_rl.algorithms.grpo import advantages, informative_groups
from dataplane_rl.config import Config
from dataplane_rl.errors import StoreUnavailableError
from dataplane_rl import trace
from dataplane_rl.ray_calls import get_all
from dataplane_rl.rollout.worker import RolloutWorker
from dataplane_rl.store import owners, to_numpy
from dataplane_rl.run import private_ray
from dataplane_rl.driver import validation
from dataplane_rl.columns.rowsets import RowSet, fetch, merge, rowset_size, save_parquet, select, shard_balanced, write
from dataplane_rl.train.packing import balance_by_tokens, refuse_over_budget
from dataplane_rl.run.reaper import deferred_sigint
from dataplane_rl.driver.data_faults import DataFaults
from dataplane_rl.driver.recovery import RolloutRecovery
from dataplane_rl.driver.samples import train_data_rows
from dataplane_rl.driver.rollouts import Rollouts, fresh_groups
from dataplane_rl.driver.step_io import DynamicSamplingError, Groups, StepIO
from dataplane_rl.driver.step_metrics import step_metrics
from dataplane_rl.driver.store_faults import dead_store
from dataplane_rl.driver.transport import DriverTransport
from dataplane_rl.train.worker import TrainWorker
from dataplane_rl.driver.preflight import open_run_store, preflight, torch_threads


class GRPOTrainer:
    def __init__(self, cfg: Config) -> None:
        self.cfg = cfg
        self.schema = cfg.run_schema()
        self.task, self.model_folder, self.sampler = preflight(cfg)  # sampler: the steps' prompts (tasks/prompts.py)
        validation.check_task(cfg.grpo, self.task)
        self.store = None
        self.rollouts_dir: Path | None = None  # logger.save_rollouts: the run folder's rollouts/ (set by loop.py)
        self.transport: DriverTransport | None = None
        self.store_url: str | None = None
        self.rollout: list = []
        self.workers: list = []
        self.rollouts = Rollouts(self)
        self.recovery = RolloutRecovery(self)  # dead rollout actors replaced, the run's faults (driver/recovery.py)
        self.data_faults = DataFaults(self, self.recovery.faults)  # failed groups left out (driver/data_faults.py)
        self.policy_ref = None  # the last refit's full state dict, in the object store
        self.version = self.in_step = 0  # the weights' version: the last training step done (0: the initial ones)
        self.trained = False  # the step under way has stepped the optimizer
        self._refits: list = []  # async: rollout actors' load_weights calls not yet confirmed, (slot, actor, future)
        self._last_step_end: float | None = None
        self._groups: list = []  # placement groups: rollout, train
        self.nodes: dict[str, list[str]] = {}  # node IP per rollout actor and per train rank
        self.train_pids: list[int] = []
        self._ray_started = False
        self.ray_lost = False  # Ray's processes were stopped under us: close() must not wait on them
        self._unprivate = None  # undoes private_ray.make_private once this run's Ray is shut down
        self.kept_store_url: str | None = None
        trace.configure(cfg.logger.trace_max_events > 0, "driver", trace.actor_roles(cfg.generation.num_workers, cfg.policy.dp_size))

    # -- lifecycle ----------------------------------------------------------------------------------
    @trace.traced("start")
    def start(self) -> None:
        import ray

        from dataplane_rl.driver import placement

        cfg = self.cfg
        owners.collect_at_start()  # the stores of runs that were killed (their own --resume included)
        private_ray.collect_tokens()  # and their Ray token folders
        placement.check_store_reachable(cfg)  # before Ray: a wrong address fails in seconds
        if not ray.is_initialized():
            if not cfg.cluster.address:
                self._unprivate = private_ray.make_private()
            # set first: a Ctrl-C inside ray.init must still shut down what it started (close())
            self._ray_started = True
            # address="local": without it ray.init() joins whatever /tmp/ray/ray_current_cluster names,
            # even a dead `ray start` head, instead of starting this run's own instance
            ray.init(address=cfg.cluster.address or "local", num_cpus=cfg.cluster.num_cpus if not cfg.cluster.address else None,
                     include_dashboard=cfg.cluster.include_dashboard, logging_level="WARNING", log_to_driver=True)
            private_ray.stop_unused(cfg)  # Ray's dashboard and monitor, which nothing of the run uses
            # after the join: ray.init(address="auto") turns token auth on when it finds the user's token
            for line in (private_ray.open_warning(cfg), private_ray.security_line(cfg)):
                if line:
                    print(line, file=sys.stderr)
        ray_nodes = placement.alive_nodes()
        placement.check_backend_spans(cfg, ray_nodes)
        self.store = open_run_store(cfg)
        self.transport = DriverTransport(self.store, cfg.data_plane.enabled)
        self.store_url = self.transport.url
        if cfg.data_plane.keep_partitions:
            if hasattr(self.store, "keep"):
                self.store.keep()  # an auto-made shm:// folder must outlive the run, or nothing is kept
            self.kept_store_url = self.store_url
            print(f"data_plane.keep_partitions: every step's partition stays in {self.store_url}\n"
                  f"  inspect: dataplane-rl store ls {self.store_url}   free: dataplane-rl store drop "
                  f"{self.store_url} --all", file=sys.stderr)
        cfg_dict = cfg.model_dump(mode="json", by_alias=True)
        gen_threads, train_threads = torch_threads(cfg, os.cpu_count() or 1)
        N, D = cfg.generation.num_workers, cfg.policy.dp_size
        rollout_gpus, train_gpus = placement.gpu_plan(cfg)
        self._groups = [placement.placement_group("rollout", N, rollout_gpus, cfg, ray_nodes),
                        placement.placement_group("train", D, train_gpus, cfg, ray_nodes)]
        self.recovery.spec = (cfg_dict, gen_threads, rollout_gpus)
        self.rollout = [self.recovery.spawn(i) for i in range(N)]
        Train = ray.remote(TrainWorker)
        self.workers = [Train.options(**placement.options(self._groups[1], r, train_gpus)).remote(
            cfg_dict, self.model_folder, self.store_url, r, D, train_threads) for r in range(D)]
        self.nodes = {"rollout": placement.node_ips(self.rollout), "train": placement.node_ips(self.workers)}
        self.train_pids = placement.pids(self.workers)  # a dead rank's output is found by its PID (driver/train_faults.py)
        placement.pin_gloo_interfaces(self.workers)
        init_method = ray.get(self.workers[0].address.remote())  # rank 0's node IP
        self.recovery.pids = ray.get([w.init_dist.remote(init_method) for w in self.workers]
                                     + [a.ready.remote() for a in self.rollout])[D:]

    @trace.traced("close")
    def close(self, keep_ray: bool = False) -> None:
        """Stop actors, the store and Ray, each even if an earlier one fails; a Ctrl-C meanwhile waits.
        keep_ray: an in-run resume (driver/restart.py): every actor is killed without asking it to close (a
        train rank may wait in a collective for a dead one), and Ray stays up for the trainer that follows."""
        import ray

        with deferred_sigint():
            try:
                # a rollout actor with batches sent ahead would generate them all before close(): just kill it
                polite = [] if keep_ray else self.workers + ([] if self.rollouts.pending else self.rollout)
                # with Ray gone, every call below would wait 30-60 s for a GCS that is not coming back
                for actor, role in [] if self.ray_lost else zip(self.rollout + self.workers,
                                                                     trace.actor_roles(len(self.rollout), len(self.workers))):
                    if any(actor is a for a in polite):
                        with contextlib.suppress(Exception):  # the actor may already be dead; the kill is what matters
                            trace.absorb(ray.get(actor.close.remote(), timeout=30), role)  # its last events
                    with contextlib.suppress(Exception):
                        ray.kill(actor)
            finally:
                self.rollout, self.workers = [], []
                for pg in [] if self.ray_lost else self._groups:
                    with contextlib.suppress(Exception):  # gone with a dead cluster
                        ray.util.remove_placement_group(pg)
                self._groups = []
                try:
                    if self.store is not None:
                        self.rollouts.close()
                        self.store.close()
                        self.store = None
                finally:
                    if not keep_ray:  # else the next trainer takes over _ray_started and _unprivate (driver/restart.py)
                        self._stop_ray()

    def _stop_ray(self) -> None:
        import ray

        if self._ray_started and self.ray_lost:
            # ray.shutdown (and Ray's own atexit call of it) would block ~20-60 s in the core
            # worker's goodbye to a dead raylet; the CLI's reaper stops what is left of Ray
            import atexit

            atexit.unregister(ray.shutdown)
            self._ray_started = False
        elif self._ray_started:
            ray.shutdown()
            self._ray_started = False
        if self._unprivate is not None:
            self._unprivate()
            self._unprivate = None

    def refit(self, wait: bool = True) -> float:
        """Hand the policy's weights (version `self.version`) to the rollout actors, gathered once (rank 0's
        copy), as one object-store reference every actor reads. wait: block until every engine has them and
        return the slowest engine's load seconds; else they land after the actors' batches in flight."""
        import ray

        refs = [w.state_dict.remote() for w in self.workers]  # collective; ranks > 0 return {}
        get_all(refs[1:])  # a dead rank is seen at once, not after the others' collective times out
        self.policy_ref = refs[0]
        self.recovery.keep_weights(self.version, self.policy_ref)
        if not wait:
            self._refits += [(i, a, a.load_weights.remote(self.policy_ref, self.version)) for i, a in enumerate(self.rollout)]
            return 0.0
        n = len(self.rollout)
        seconds = max(self.recovery.on_all(f"step {self.version}: refit", "load_weights", [self.policy_ref] * n,
                                           [self.version] * n))
        self._refits = []  # every engine holds these weights now, a replacement's included
        return seconds

    def rollout_round(self, pid: str, step: int, round_: int, prompts: list, G: int, io: StepIO | None = None,
                      group_offset: int = 0, validation: bool = False) -> list[dict]:
        """Create partition `pid`, have the rollout actors fill it with G samples per prompt; the receipts."""
        return self.rollouts.collect(self.rollouts.send(pid, step, round_, prompts, G, group_offset, validation), io)

    # -- one step, in phases ------------------------------------------------------------------------
    def step(self, step: int) -> tuple[dict, list[dict]]:
        io = StepIO()
        self.in_step = step  # the step under way, for the faults a recovery records
        self.trained = False  # until the optimizer steps: a lost store can still be regenerated (driver/restart.py)
        t_step = time.perf_counter()
        got = self.collect_groups(step, io)
        if self.cfg.grpo.async_grpo.in_flight_weight_updates:  # async/token_age_* and mixed_version_samples
            got.token_versions = self.read(got.rs, ["token_policy_version"], io).column(0).combine_chunks()
        rewards = self.advantages_and_masks(got, io)
        # the run folder's rows are read before the optimizer steps: after them the step reads nothing from the
        # store, so a store lost then costs nothing of the step (driver/restart.py)
        samples = self.train_data(got.rs, io)
        per_rank_steps = self.shard(got)
        self.logprobs(per_rank_steps, io)
        if self.rollouts_dir is not None:
            save_parquet(self.store, got.rs, self.rollouts_dir / f"step_{step:06d}.parquet")
        train = self.train(per_rank_steps, io)
        self.trained = True
        self.version = step
        self.refit_phase(io)
        if not self.cfg.data_plane.keep_partitions:
            self._drop(got.pids)
        io.timing["step"] = time.perf_counter() - t_step
        return self.log(step, train, got, rewards, io), samples

    @trace.traced("collect_groups")
    def collect_groups(self, step: int, io: StepIO) -> Groups:
        """Whole groups for the step: the step's round partition (sent ahead in async mode), then, with
        dynamic sampling or stale rows, more rounds with the current weights until P groups are kept.
        A group is kept only if it is informative (dynamic sampling) and every row's version is at least
        step-1-age (async; sync rows are always version step-1)."""
        g = self.cfg.grpo
        P = g.num_prompts_per_step
        oldest = step - 1 - (self.rollouts.ahead or 0)
        kept: list = []  # (pid, rows of one whole group)
        scalars: dict[str, pa.Table] = {}  # per round partition: its DRIVER_FIELDS on its written rows, read once
        written: dict[str, np.ndarray] = {}  # per round partition: those rows (not a failed group's)
        rounds_rewards, rounds_sources, dropped, refits = [], [], 0, 0
        generated = flat = round_ = 0
        rounds = g.max_gen_batches if g.use_dynamic_sampling or self.rollouts.ahead else 1
        while round_ < rounds:
            p = self.rollouts.first_round(step) if round_ == 0 else self.rollouts.send_round(step, round_)
            receipts = self.rollouts.collect(p, io)
            io.timing["generate"] = io.timing.get("generate", 0.0) + max(r["generate_s"] for r in receipts)
            refits += sum(r.get("in_flight_refits", 0) for r in receipts)
            sc, rows = self.data_faults.read_round(step, p, receipts, self.schema.field_set("DRIVER_FIELDS"), io)
            scalars[p.pid], written[p.pid] = sc, rows
            if len(rows) < p.G * sum(len(j.prompts) for j in p.jobs):  # failed groups: one more round may replace them
                rounds = max(rounds, min(round_ + 2, g.max_gen_batches))
            round_ += 1
            rewards = to_numpy(sc.column("total_reward")).astype(np.float64)
            groups = to_numpy(sc.column("group_id"))
            rounds_rewards.append(rewards)
            rounds_sources += sc.column("data_source").to_pylist()
            uniq = np.unique(groups)
            generated += len(uniq)
            flat += len(uniq) - len(informative_groups(rewards, groups))
            keep, stale = fresh_groups(to_numpy(sc.column("generation_policy_version")), groups, oldest)
            dropped += stale
            if g.use_dynamic_sampling:
                keep = np.intersect1d(keep, informative_groups(rewards, groups))
            for gid in keep:
                if len(kept) < P:
                    kept.append((p.pid, rows[groups == gid]))
            if len(kept) >= P:
                break
        if len(kept) < P:
            self._drop(list(scalars))
            raise DynamicSamplingError(
                f"step {step}: kept {len(kept)} of {P} groups (non-equal rewards with grpo.use_dynamic_sampling, "
                f"versions >= {oldest} with grpo.async_grpo; {dropped} stale rows dropped) after {len(scalars)} "
                f"rounds (grpo.max_gen_batches={g.max_gen_batches}); raise grpo.max_gen_batches, lower "
                "grpo.num_prompts_per_step, or turn grpo.use_dynamic_sampling off")
        rs = merge([[k] for k in kept])  # the kept rows, whole groups in order, by partition
        sc = pa.concat_tables([scalars[pid].take(pa.array(np.searchsorted(written[pid], rows))) for pid, rows in rs])
        return Groups(rs, sc, list(scalars), rounds_rewards, rounds_sources, dropped, generated, flat, refits)

    @trace.traced("advantages")
    def advantages_and_masks(self, got: Groups, io: StepIO) -> np.ndarray:
        """Per-sample advantages and sample_mask, put as driver columns; returns the kept rewards."""
        g, sc = self.cfg.grpo, got.scalars
        rewards = to_numpy(sc.column("total_reward")).astype(np.float64)
        groups = to_numpy(sc.column("group_id"))
        # group ids repeat across rounds: make them unique per (round partition, group)
        seg = np.concatenate([np.full(len(rows), i) for i, (_, rows) in enumerate(got.rs)])
        unique_groups = seg * (g.num_prompts_per_step + 1) + groups
        adv = advantages(rewards, unique_groups, normalize=g.normalize_rewards, leave_one_out=g.use_leave_one_out_baseline)
        truncated = to_numpy(sc.column("truncated")).astype(bool)
        sample_mask = np.where(truncated & g.overlong_filtering, 0, 1).astype(np.int8)
        t0 = time.perf_counter()
        io.bytes_written += write(self.store, got.rs, pa.table({"advantages": pa.array(adv), "sample_mask": pa.array(sample_mask)}))
        io.put_s += time.perf_counter() - t0
        return rewards

    def shard(self, got: Groups) -> list[list[RowSet]]:
        """Global batches in row-set order, each split over the ranks balanced by tokens: per rank, one
        row set per optimizer step."""
        lengths = to_numpy(got.scalars.column("input_lengths")).astype(np.int64)
        p = self.cfg.policy
        n, GB, D = rowset_size(got.rs), p.train_global_batch_size, p.dp_size
        budgets = p.token_budgets()
        refuse_over_budget(lengths, got.rs, p)
        # token budgets make the pass counts differ anyway (evened by empty passes): give rows by tokens only
        split = balance_by_tokens if budgets else shard_balanced
        per_rank: list[list[RowSet]] = [[] for _ in range(D)]
        for start in range(0, n, GB):
            pos = np.arange(start, min(start + GB, n))
            for r, shard in enumerate(split(lengths[pos], D)):
                per_rank[r].append(select(got.rs, pos[shard]))
        return per_rank

    @trace.traced("logprobs")
    def logprobs(self, per_rank_steps: list[list[RowSet]], io: StepIO) -> None:
        """prev_logprobs under the current weights (and the reference's), written as columns."""
        t0 = time.perf_counter()
        self.transport.call(self.workers, "logprobs", [merge(s) for s in per_rank_steps],
                            self.schema.field_set("LOGPROB_SEED_FIELDS"))
        io.timing["logprobs"] = time.perf_counter() - t0

    @trace.traced("train")
    def train(self, per_rank_steps: list[list[RowSet]], io: StepIO) -> dict:
        """The optimizer steps; returns rank 0's global metrics."""
        import ray

        t0 = time.perf_counter()
        results = self.transport.call(self.workers, "train", per_rank_steps, self.cfg.train_fields(self.schema))
        io.timing["train"] = time.perf_counter() - t0
        for r, receipt in enumerate(ray.get([w.take_io.remote() for w in self.workers])):
            io.add(receipt)
            trace.absorb(receipt.pop("trace", None), f"train-rank-{r}")
        return results[0]

    @trace.traced("refit")
    def refit_phase(self, io: StepIO) -> None:
        """Sync: the rollout actors load the new weights before the next step. Async: they load them after
        the batches in flight, and the steps those weights may generate are sent at once."""
        t0 = time.perf_counter()
        if self.rollouts.ahead is None:
            io.timing["refit_engine"] = self.refit()
        else:
            self.refit(wait=False)  # earlier refits' errors surface here; a dead actor is replaced
            io.timing["refit_engine"] = self.recovery.settle_refits(f"step {self.version}: refit")
            self.rollouts.send_ahead(self.version)
        io.timing["refit"] = time.perf_counter() - t0

    @trace.traced("train_data")
    def train_data(self, rs: RowSet, io: StepIO) -> list[dict]:
        """The trained rows for the run folder's train_data/ file."""
        return train_data_rows(rs, self.read(rs, self.schema.field_set("TRAIN_DATA_FIELDS"), io))

    def read(self, rs: RowSet, fields, io: StepIO) -> pa.Table:
        """Columns of the row set, read by the driver (data_plane/driver_bytes_read)."""
        t0 = time.perf_counter()
        data = fetch(self.store, rs, fields)
        io.driver_bytes_read += data.nbytes
        io.get_s += time.perf_counter() - t0
        return data

    def _drop(self, pids: list[str]) -> None:
        """Drop the step's partitions; with the run's Mooncake store lost, they went with it (the next store
        operation replaces the store: driver/restart.py)."""
        for pid in pids:
            try:
                self.store.drop_partition(pid)
            except StoreUnavailableError as e:
                if not dead_store(self.store, e):
                    raise
                return

    def log(self, step: int, train: dict, got: Groups, kept_rewards: np.ndarray, io: StepIO) -> dict:
        """The step's metrics (driver/step_metrics.py)."""
        now = time.perf_counter()
        since = now - (self._last_step_end if self._last_step_end is not None else now - io.timing["step"])
        self._last_step_end = now
        return step_metrics(step, train, got, kept_rewards, io, since=since, epochs=self.cfg.grpo.num_epochs,
                            async_on=self.rollouts.ahead is not None, data_plane=bool(self.store_url),
                            counters={**self.recovery.counters(), **self.data_faults.counters(),
                                      **self.sampler.counters()})
