"""The Fleet (docs/architecture.md §4): the run's processes and their handles, started and closed together.

It owns the rollout actors, the train group, the step store and its transport, and the refits not yet
confirmed. Everything else talks to the processes through its public interface: `start`, `close`,
`replace_rollout` (a dead actor's slot), `reopen_store` (a store that lost a holder), `call_ranks` and
`call_rollouts` (every train rank, every rollout actor), `refit` and `resume_at` (the weights to the actors).
A fault of the run is recorded in the run's ledger (run/ledger.py), which outlives the fleet.
"""

from __future__ import annotations

import contextlib
import os
import sys
from pathlib import Path

from dataplane_rl import trace
from dataplane_rl.config import Config
from dataplane_rl.ray_calls import get_all
from dataplane_rl.store.shm import owners
from dataplane_rl.run import private_ray
from dataplane_rl.run.ledger import FaultLedger
from dataplane_rl.run.reaper import deferred_sigint
from dataplane_rl.run.run import RayOwner
from dataplane_rl.driver import placement, validation
from dataplane_rl.faults.data import DataFaults
from dataplane_rl.faults.rollout_actors import RolloutRecovery
from dataplane_rl.driver.rollouts import Rollouts
from dataplane_rl.driver.step_io import StepIO
from dataplane_rl.driver.transport import DriverTransport
from dataplane_rl.train.worker import TrainWorker
from dataplane_rl.driver.preflight import open_run_store, preflight, torch_threads
from dataplane_rl.model.describe import parameter_count


class Fleet:
    """`ray`: the run's RayOwner (run/run.py; None: the fleet owns Ray itself and stops it on close); `ledger`: the
    run's fault ledger (None: one of its own)."""

    ready_timeout_s = placement.READY_TIMEOUT_S  # how long a new actor may take to start

    def __init__(self, cfg: Config, ray: RayOwner | None = None, ledger: FaultLedger | None = None) -> None:
        self.cfg = cfg
        self.schema = cfg.run_schema()
        self.task, self.model_folder, self.sampler = preflight(cfg)  # sampler: the steps' prompts (tasks/prompts.py)
        validation.check_task(cfg.grpo, self.task)
        self.ray, self._owns_ray = ray or RayOwner(), ray is None
        self.ledger = ledger or FaultLedger()
        self.store = None
        self.rollouts_dir: Path | None = None  # logger.save_rollouts: the run folder's rollouts/ (set by loop.py)
        self.transport: DriverTransport | None = None
        self.store_url: str | None = None
        self.kept_store_url: str | None = None
        self.rollout: list = []  # the rollout actors, by slot
        self.rollout_pids: list[int] = []
        self.workers: list = []  # the train ranks
        self.train_pids: list[int] = []
        # why a step scores prev_logprobs in the log-prob pass (config/on_policy.py; the ranks add a policy with
        # dropout); []: an exactly on-policy step takes them from its train forward
        self.prev_pass: list[str] = []
        self.nodes: dict[str, list[str]] = {}  # node IP per rollout actor and per train rank
        self.driver_node: str | None = None  # the driver's node IP
        self.rollouts = Rollouts(self)
        self.recovery = RolloutRecovery(self, self.ledger)  # dead rollout actors replaced (faults/rollout_actors.py)
        self.data_faults = DataFaults(self, self.ledger)  # failed groups left out (faults/data.py)
        self.policy_ref = None  # the last refit's weights: a state dict in the object store, or a SharedWeights
        self.version = self.in_step = 0  # the weights' version: the last training step done (0: the initial ones)
        self.trained = False  # the step under way has stepped the optimizer
        self.refits: list = []  # async: rollout actors' load_weights calls not yet confirmed, (slot, actor, future)
        self.last_step_end: float | None = None
        self._groups: list = []  # placement groups: rollout, train
        self._spec: tuple = ()  # (config dict, torch threads, GPUs per actor): what start() made the actors with
        trace.configure(cfg.logger.trace_max_events > 0, "driver", trace.actor_roles(cfg.generation.num_workers, cfg.policy.dp_size))

    @property
    def ray_lost(self) -> bool:
        """Ray's processes were stopped under us: close() must not wait on them."""
        return self.ray.lost

    # -- lifecycle ----------------------------------------------------------------------------------
    @trace.traced("start")
    def start(self) -> None:
        import ray

        cfg = self.cfg
        owners.collect_at_start()  # the stores of runs that were killed (their own --resume included)
        private_ray.collect_tokens()  # and their Ray token folders
        placement.check_store_reachable(cfg)  # before Ray: a wrong address fails in seconds
        self.ray.start(cfg)
        ray_nodes = placement.alive_nodes()
        placement.check_backend_spans(cfg, ray_nodes)
        self.store = open_run_store(cfg)
        self.transport = DriverTransport(self.store, cfg.data_plane.enabled)
        self.store_url = self.transport.url
        if cfg.data_plane.keep_partitions:
            self.store.keep()  # an auto-made shm:// folder must outlive the run, or nothing is kept
            self.kept_store_url = self.store_url
            print(f"data_plane.keep_partitions: every step's partition stays in {self.store_url}\n"
                  f"  inspect: dataplane-rl store ls {self.store_url}   free: dataplane-rl store drop "
                  f"{self.store_url} --all", file=sys.stderr)
        cfg_dict = cfg.model_dump(mode="json", by_alias=True)
        gen_threads, train_threads = torch_threads(cfg, os.cpu_count() or 1, parameter_count(self.model_folder))
        N, D = cfg.generation.num_workers, cfg.policy.dp_size
        rollout_gpus, train_gpus = placement.gpu_plan(cfg)
        self._groups = [placement.placement_group("rollout", N, rollout_gpus, cfg, ray_nodes),
                        placement.placement_group("train", D, train_gpus, cfg, ray_nodes)]
        self._spec = (cfg_dict, gen_threads, rollout_gpus)
        self.rollout = [self._spawn(i) for i in range(N)]
        Train = ray.remote(TrainWorker)
        self.workers = [Train.options(**placement.options(self._groups[1], r, train_gpus)).remote(
            cfg_dict, self.model_folder, self.store_url, r, D, train_threads) for r in range(D)]
        self.nodes = {"rollout": placement.node_ips(self.rollout), "train": placement.node_ips(self.workers)}
        self.driver_node = ray.util.get_node_ip_address()
        self.train_pids = placement.pids(self.workers)  # a dead rank's output is found by its PID (faults/train_ranks.py)
        placement.pin_gloo_interfaces(self.workers)
        init_method = ray.get(self.workers[0].address.remote())  # rank 0's node IP
        self.rollout_pids = ray.get([w.init_dist.remote(init_method) for w in self.workers]
                                    + [a.ready.remote() for a in self.rollout])[D:]
        self.prev_pass = ray.get(self.workers[0].prev_logprobs_pass.remote())  # every rank holds the same policy

    def _spawn(self, slot: int):
        """A rollout actor on bundle `slot` of the rollout placement group (not yet ready)."""
        from dataplane_rl.rollout.worker import actor_class

        cfg_dict, threads, gpus = self._spec
        cls = actor_class(self.cfg.grpo.async_grpo.in_flight_weight_updates)
        return cls.options(**placement.options(self._groups[0], slot, gpus)).remote(
            cfg_dict, self.model_folder, self.store_url, threads)

    @trace.traced("close")
    def close(self, kill: bool = False) -> None:
        """Stop actors and the store (and Ray, if the fleet owns it), each even if an earlier one fails; a Ctrl-C
        meanwhile waits. kill: an in-run resume (faults/restart.py): every actor is killed without asking it to
        close (a train rank may wait in a collective for a dead one)."""
        import ray

        with deferred_sigint():
            try:
                # a rollout actor with batches sent ahead would generate them all before close(): just kill it
                polite = [] if kill else self.workers + ([] if self.rollouts.pending else self.rollout)
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
                    if self._owns_ray and not kill:
                        self.ray.stop()

    # -- the recoveries' interface (faults/) ---------------------------------------------------------
    def replace_rollout(self, slot: int) -> int:
        """Kill the (dead) rollout actor of `slot` and start a new one there; returns its PID. Its node is recorded;
        the old actor's unconfirmed refits are forgotten. Raises what the new actor's start raised."""
        import ray

        old = self.rollout[slot]
        try:
            ray.kill(old)  # already dead: this only frees its name and resources at once
        except Exception:  # noqa: BLE001 - a dead actor may refuse the kill; it is gone either way
            pass
        self.refits[:] = [(i, a, f) for i, a, f in self.refits if a is not old]
        actor = self._spawn(slot)
        pid = ray.get(actor.ready.remote(), timeout=self.ready_timeout_s)
        self.rollout[slot], self.rollout_pids[slot] = actor, pid
        self.nodes["rollout"][slot] = placement.node_ips([actor])[0]
        return pid

    def reopen_store(self) -> None:
        """Replace the run's store with a new one that every actor opens; the rounds in flight are forgotten."""
        import ray

        open_calls = [f for p in self.rollouts.open.values() for f in p.futures]
        if open_calls:  # the step's jobs finish (failing, or writing to the dead store) before the actors reopen
            ray.wait(open_calls, num_returns=len(open_calls), timeout=120)
        old = self.store
        with contextlib.suppress(Exception):  # its master or holders are gone: what is left is stopped regardless
            old.close()
        with contextlib.suppress(Exception):
            old.stop_processes()
        self.rollouts.forget()
        self.store = open_run_store(self.cfg)
        self.transport = DriverTransport(self.store, True)
        self.store_url = self.transport.url
        get_all([a.reopen_store.remote(self.store_url) for a in self.rollout + self.workers], timeout=120)
        self.recovery.write()  # actors.json: the new store's processes

    def local_roles(self) -> dict[int, str]:
        """{PID: role} of the train ranks and rollout actors on the driver's node, whose memory the driver can read
        (run/memory.py)."""
        out = {}
        for kind, pids, role in (("train", self.train_pids, "train-rank"), ("rollout", self.rollout_pids, "rollout")):
            for i, (pid, node) in enumerate(zip(pids, self.nodes.get(kind, []))):
                if node == self.driver_node:
                    out[pid] = f"{role}-{i}"
        return out

    # -- calls on every process ---------------------------------------------------------------------
    def call_ranks(self, method: str, *args) -> list:
        """`method(*args)` on every train rank; a dead rank's error is raised at once (ray_calls.get_all)."""
        return get_all([getattr(w, method).remote(*args) for w in self.workers])

    def call_rollouts(self, what: str, method: str, *per_slot_args) -> list:
        """`method` on every rollout actor (with its slot's arguments); a dead actor is replaced and asked again."""
        return self.recovery.on_all(what, method, *per_slot_args)

    def refit(self, wait: bool = True) -> float:
        """Hand the policy's weights (version `self.version`) to the rollout actors, gathered once (rank 0's
        copy): one file in shared memory that every actor maps (shares_weights; on a synchronous one-rank run the
        rank's own parameters, no copy at all), or else one object-store reference
        every actor reads. wait: block until every engine has them and return the slowest engine's load seconds;
        else they land after the actors' batches in flight."""
        if self.shares_weights():
            # kept: the versions an open job was sent with (a replacement actor replays the job with them), and,
            # async, those a refit not yet confirmed may still load (its actor's batches before it make the rows of
            # the steps up to `age` ahead, so none older than that is pending)
            overlap = self.cfg.grpo.async_grpo
            age = overlap.max_trajectory_age_steps if overlap.enabled else 0
            pending = set(range(self.version - age, self.version))
            need = sorted({p.version for p in self.rollouts.open.values()} | pending)
            # synchronous, one rank, no job open: no actor generates while the rank trains, so the actors may view
            # the rank's own parameters (a refit without a copy); else each version is a copy of its own
            live = not overlap.enabled and self.cfg.policy.dp_size == 1 and not need
            refs = [w.publish_weights.remote(self.version, need, live) for w in self.workers]
            self.policy_ref = get_all(refs)[0]  # a SharedWeights: the actors map rank 0's file
        else:
            self.policy_ref = self._gathered()
        self.recovery.keep_weights(self.version, self.policy_ref)
        if not wait:
            self.refits += [(i, a, a.load_weights.remote(self.policy_ref, self.version)) for i, a in enumerate(self.rollout)]
            return 0.0
        n = len(self.rollout)
        seconds = max(self.call_rollouts(f"step {self.version}: refit", "load_weights", [self.policy_ref] * n,
                                         [self.version] * n))
        self.refits[:] = []  # every engine holds these weights now, a replacement's included
        return seconds

    def shares_weights(self) -> bool:
        """Refits go through shared memory (model/shared_weights.py): the Hugging Face engine, whose actors all run
        on train rank 0's node, without in-flight updates (a refit waiting in an engine's slot may outlive its file);
        else rank 0's state dict goes through the object store (vLLM loads its own copy)."""
        nodes = self.nodes.get("train", [])[:1]
        in_flight = self.cfg.grpo.async_grpo.in_flight_weight_updates
        return (self.cfg.generation.backend == "hf" and not in_flight and bool(nodes)
                and set(self.nodes.get("rollout", [])) <= set(nodes))

    def _gathered(self):
        """Rank 0's full state dict, gathered once, as an object-store reference."""
        refs = [w.state_dict.remote() for w in self.workers]  # collective; ranks > 0 return {}
        get_all(refs[1:])  # a dead rank is seen at once, not after the others' collective times out
        return refs[0]

    def policy_state(self) -> dict:
        """The policy's full state dict, here (the run's `policy/` export): the last refit's, or gathered now where
        that refit went through shared memory or none was made."""
        import ray

        return ray.get(self.policy_ref if isinstance(self.policy_ref, ray.ObjectRef) else self._gathered())

    def resume_at(self, version: int) -> None:
        """The train ranks hold the weights after step `version` (a checkpoint loaded): the rollout actors get them."""
        self.version = version
        self.refit()

    def rollout_round(self, pid: str, step: int, round_: int, prompts: list, G: int, io: StepIO | None = None,
                      group_offset: int = 0, validation: bool = False) -> list[dict]:
        """Create partition `pid`, have the rollout actors fill it with G samples per prompt; the receipts."""
        return self.rollouts.collect(self.rollouts.send(pid, step, round_, prompts, G, group_offset, validation), io)
