"""The Fleet (docs/architecture.md §4): the run's processes and their handles, started and closed together.

It owns the rollout actors, the train group, the step store and its transport; their handles, PIDs and nodes
are private. Everything else talks to the processes through its methods: `start`, `close`, `replace_rollout`
(a dead actor's slot), `reopen_store` (a store that lost a holder), `call_ranks` and `call_rollouts` (every
train rank, every rollout actor), `send` (a step's jobs to the train ranks through the transport), `refit` and
`resume_at` (the weights to the actors), `processes` (who runs where). What the steps have done with the
processes (the weights' version, the step under way, the refits not yet confirmed) is the run's Progress
(run/progress.py), which the run loop owns and hands in; a fault is recorded in the run's ledger
(run/ledger.py). Both outlive the fleet. The recoveries (faults/) see the fleet through their two protocols,
RolloutSlots and TrainGroup (faults/ports.py), which it implements.
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
from dataplane_rl.run.progress import Progress
from dataplane_rl.run.reaper import deferred_sigint
from dataplane_rl.run.run import RayOwner
from dataplane_rl.driver import placement, validation
from dataplane_rl.faults.data import DataFaults
from dataplane_rl.faults.rollout_actors import RolloutRecovery
from dataplane_rl.faults.store import dead_store
from dataplane_rl.driver.rollouts import Rollouts
from dataplane_rl.driver.step_io import StepIO
from dataplane_rl.driver.transport import DriverTransport
from dataplane_rl.train.worker import TrainWorker
from dataplane_rl.driver.preflight import open_run_store, preflight, torch_threads
from dataplane_rl.model.describe import parameter_count


class Fleet:
    """`ray`: the run's RayOwner (run/run.py; None: the fleet owns Ray itself and stops it on close); `ledger`: the
    run's fault ledger (None: one of its own); `progress`: the run's record of its steps (None: one of its own)."""

    ready_timeout_s = placement.READY_TIMEOUT_S  # how long a new actor may take to start

    def __init__(self, cfg: Config, ray: RayOwner | None = None, ledger: FaultLedger | None = None,
                 progress: Progress | None = None) -> None:
        self.cfg = cfg
        self.schema = cfg.run_schema()
        task, self.model_folder, self.sampler = preflight(cfg)  # sampler: the steps' prompts (tasks/prompts.py)
        validation.check_task(cfg.grpo, task)
        self.ledger = ledger or FaultLedger()
        self._ray, self._owns_ray = ray or RayOwner(), ray is None
        self._progress = progress or Progress()
        self._store = None
        self._transport: DriverTransport | None = None
        self._kept_url: str | None = None  # data_plane.keep_partitions: the store left behind for `store ls`
        self._rollout: list = []  # the rollout actors, by slot
        self._rollout_pids: list[int] = []
        self._workers: list = []  # the train ranks
        self._train_pids: list[int] = []
        # why a step scores prev_logprobs in the log-prob pass (config/on_policy.py; the ranks add a policy with
        # dropout); []: an exactly on-policy step takes them from its train forward
        self._prev_pass: list[str] = []
        self._nodes: dict[str, list[str]] = {}  # node IP per rollout actor and per train rank
        self._driver_node: str | None = None  # the driver's node IP
        self._groups: list = []  # placement groups: rollout, train
        self._spec: tuple = ()  # (config dict, torch threads, GPUs per actor): what start() made the actors with
        # dead rollout actors replaced (faults/rollout_actors.py), failed groups left out (faults/data.py)
        self._recovery = RolloutRecovery(self, self._progress, self.ledger, cfg.fault_tolerance.max_generation_failures)
        self.rollouts = Rollouts(self, self._progress, self._recovery, DataFaults(cfg, self.ledger))
        trace.configure(cfg.logger.trace_max_events > 0, "driver", trace.actor_roles(cfg.generation.num_workers, cfg.policy.dp_size))

    # -- what the others read -----------------------------------------------------------------------
    @property
    def store(self):
        """The run's store (the driver's in-memory one with the data plane off); None before start and after close."""
        return self._store

    @property
    def prev_pass(self) -> list[str]:
        """Why a step scores prev_logprobs in the log-prob pass ([]: an exactly on-policy step takes them from its
        train forward)."""
        return self._prev_pass

    def store_address(self) -> str | None:
        """The URL every actor opens the run's store by; None: the data plane is off (the columns stay here)."""
        return self._transport.url if self._transport is not None else None

    def kept_url(self) -> str | None:
        """The store data_plane.keep_partitions leaves behind after the run (summary.json kept_store_url)."""
        return self._kept_url

    def nodes(self) -> dict[str, list[str]]:
        """The node IP of each rollout actor and of each train rank."""
        return {k: list(v) for k, v in self._nodes.items()}

    def processes(self) -> dict:
        """Each rollout actor's and train rank's PID and node, and the processes of the run's own Mooncake store
        (its master and holders): what RUN_DIR/actors.json holds."""
        rows = [dict(zip(("slot", "pid", "node"), (i, *self.where(i)))) for i in range(len(self._rollout_pids))]
        train = [dict(zip(("rank", "pid", "node"), (r, *self.rank_where(r)))) for r in range(len(self._train_pids))]
        store = self._store.processes() if self._store is not None else []
        return {"rollout": rows, "train": train, "store": store}

    def record_actors(self, run_dir: Path) -> None:
        """Keep RUN_DIR/actors.json (`processes`) up to date from now on."""
        self._recovery.record(run_dir)

    def generates_ahead(self) -> bool:
        """Whether rounds are sent ahead of the trainer (async GRPO)."""
        return self.rollouts.ahead is not None

    @property
    def _ray_lost(self) -> bool:
        """Ray's processes were stopped under us: close() must not wait on them."""
        return self._ray.lost

    # -- lifecycle ----------------------------------------------------------------------------------
    @trace.traced("start")
    def start(self) -> None:
        import ray

        cfg = self.cfg
        owners.collect_at_start()  # the stores of runs that were killed (their own --resume included)
        private_ray.collect_tokens()  # and their Ray token folders
        placement.check_store_reachable(cfg)  # before Ray: a wrong address fails in seconds
        self._ray.start(cfg)
        ray_nodes = placement.alive_nodes()
        placement.check_backend_spans(cfg, ray_nodes)
        self._store = open_run_store(cfg)
        self._transport = DriverTransport(self._store, cfg.data_plane.url is not None)
        if cfg.data_plane.keep_partitions:
            self._store.keep()  # an auto-made shm:// folder must outlive the run, or nothing is kept
            self._kept_url = self.store_address()
            print(f"data_plane.keep_partitions: every step's partition stays in {self.store_address()}\n"
                  f"  inspect: dataplane-rl store ls {self.store_address()}   free: dataplane-rl store drop "
                  f"{self.store_address()} --all", file=sys.stderr)
        cfg_dict = cfg.model_dump(mode="json", by_alias=True)
        gen_threads, train_threads = torch_threads(cfg, os.cpu_count() or 1, parameter_count(self.model_folder))
        N, D = cfg.generation.num_workers, cfg.policy.dp_size
        rollout_gpus, train_gpus = placement.gpu_plan(cfg)
        self._groups = [placement.placement_group("rollout", N, rollout_gpus, cfg, ray_nodes),
                        placement.placement_group("train", D, train_gpus, cfg, ray_nodes)]
        self._spec = (cfg_dict, gen_threads, rollout_gpus)
        self._rollout = [self._spawn(i) for i in range(N)]
        Train = ray.remote(TrainWorker)
        self._workers = [Train.options(**placement.options(self._groups[1], r, train_gpus)).remote(
            cfg_dict, self.model_folder, self.store_address(), r, D, train_threads) for r in range(D)]
        self._nodes = {"rollout": placement.node_ips(self._rollout), "train": placement.node_ips(self._workers)}
        self._driver_node = ray.util.get_node_ip_address()
        self._train_pids = placement.pids(self._workers)  # a dead rank's output is found by its PID (faults/train_ranks.py)
        placement.pin_gloo_interfaces(self._workers)
        init_method = ray.get(self._workers[0].address.remote())  # rank 0's node IP
        self._rollout_pids = ray.get([w.init_dist.remote(init_method) for w in self._workers]
                                    + [a.ready.remote() for a in self._rollout])[D:]
        self._prev_pass = ray.get(self._workers[0].prev_logprobs_pass.remote())  # every rank holds the same policy

    def _spawn(self, slot: int):
        """A rollout actor on bundle `slot` of the rollout placement group (not yet ready)."""
        from dataplane_rl.rollout.worker import actor_class

        cfg_dict, threads, gpus = self._spec
        cls = actor_class(self.cfg.grpo.async_grpo.in_flight_weight_updates)
        return cls.options(**placement.options(self._groups[0], slot, gpus)).remote(
            cfg_dict, self.model_folder, self.store_address(), threads)

    @trace.traced("close")
    def close(self, kill: bool = False) -> None:
        """Stop actors and the store (and Ray, if the fleet owns it), each even if an earlier one fails; a Ctrl-C
        meanwhile waits. kill: an in-run resume (faults/restart.py): every actor is killed without asking it to
        close (a train rank may wait in a collective for a dead one)."""
        import ray

        with deferred_sigint():
            try:
                # a rollout actor with batches sent ahead would generate them all before close(): just kill it
                polite = [] if kill else self._workers + ([] if self.rollouts.pending else self._rollout)
                # with Ray gone, every call below would wait 30-60 s for a GCS that is not coming back
                for actor, role in [] if self._ray_lost else zip(self._rollout + self._workers,
                                                                     trace.actor_roles(len(self._rollout), len(self._workers))):
                    if any(actor is a for a in polite):
                        with contextlib.suppress(Exception):  # the actor may already be dead; the kill is what matters
                            trace.absorb(ray.get(actor.close.remote(), timeout=30), role)  # its last events
                    with contextlib.suppress(Exception):
                        ray.kill(actor)
            finally:
                self._rollout, self._workers = [], []
                for pg in [] if self._ray_lost else self._groups:
                    with contextlib.suppress(Exception):  # gone with a dead cluster
                        ray.util.remove_placement_group(pg)
                self._groups = []
                try:
                    if self._store is not None:
                        self.rollouts.close()
                        self._store.close()
                        self._store = None
                finally:
                    if self._owns_ray and not kill:
                        self._ray.stop()

    # -- the recoveries' interface (faults/) ---------------------------------------------------------
    def actors(self) -> list:
        """The rollout actors' handles, by slot."""
        return list(self._rollout)

    def where(self, slot: int) -> tuple[int, str | None]:
        """The PID and node IP of the rollout actor in `slot`."""
        nodes = self._nodes.get("rollout", [])
        return self._rollout_pids[slot], nodes[slot] if slot < len(nodes) else None

    def open_rounds(self) -> list:
        """The rounds sent and not yet collected, in send order."""
        return list(self.rollouts.open.values())

    def replace_rollout(self, slot: int) -> int:
        """Kill the (dead) rollout actor of `slot` and start a new one there; returns its PID. Its node is recorded;
        the old actor's unconfirmed refits are forgotten. Raises what the new actor's start raised (a start that
        takes longer than `ready_timeout_s`: TimeoutError)."""
        import ray

        old = self._rollout[slot]
        try:
            ray.kill(old)  # already dead: this only frees its name and resources at once
        except Exception:  # noqa: BLE001 - a dead actor may refuse the kill; it is gone either way
            pass
        refits = self._progress.refits
        refits[:] = [(i, a, f) for i, a, f in refits if a is not old]
        actor = self._spawn(slot)
        try:
            pid = ray.get(actor.ready.remote(), timeout=self.ready_timeout_s)
        except ray.exceptions.GetTimeoutError:
            raise TimeoutError(f"not ready within {self.ready_timeout_s:.0f} s") from None
        self._rollout[slot], self._rollout_pids[slot] = actor, pid
        self._nodes["rollout"][slot] = placement.node_ips([actor])[0]
        return pid

    def ranks(self) -> list:
        """The train ranks' actor handles, by rank."""
        return list(self._workers)

    def rank_where(self, rank: int) -> tuple[int | None, str | None]:
        """Train rank `rank`'s PID and node IP, as recorded at start (None: not recorded)."""
        nodes = self._nodes.get("train", [])
        return (self._train_pids[rank] if rank < len(self._train_pids) else None,
                nodes[rank] if rank < len(nodes) else None)

    def dead_store_processes(self, e: BaseException | None) -> list[str]:
        """The dead processes of the run's own Mooncake store, described (empty: none, or a store the run joined)."""
        return dead_store(self._store, e) if self._store is not None else []

    def reopen_store(self) -> str:
        """Replace the run's store with a new one that every actor opens; the rounds in flight are forgotten.
        Returns the new store's URL."""
        import ray

        open_calls = [f for p in self.rollouts.open.values() for f in p.futures]
        if open_calls:  # the step's jobs finish (failing, or writing to the dead store) before the actors reopen
            ray.wait(open_calls, num_returns=len(open_calls), timeout=120)
        old = self._store
        with contextlib.suppress(Exception):  # its master or holders are gone: what is left is stopped regardless
            old.close()
        with contextlib.suppress(Exception):
            old.stop_processes()
        self.rollouts.forget()
        self._store = open_run_store(self.cfg)
        self._transport = DriverTransport(self._store, True)
        get_all([a.reopen_store.remote(self.store_address()) for a in self._rollout + self._workers], timeout=120)
        self._recovery.write()  # actors.json: the new store's processes
        return self.store_address()

    def local_roles(self) -> dict[int, str]:
        """{PID: role} of the train ranks and rollout actors on the driver's node, whose memory the driver can read
        (run/memory.py)."""
        out = {}
        for kind, pids, role in (("train", self._train_pids, "train-rank"), ("rollout", self._rollout_pids, "rollout")):
            for i, (pid, node) in enumerate(zip(pids, self._nodes.get(kind, []))):
                if node == self._driver_node:
                    out[pid] = f"{role}-{i}"
        return out

    # -- calls on every process ---------------------------------------------------------------------
    def call_ranks(self, method: str, *args) -> list:
        """`method(*args)` on every train rank; a dead rank's error is raised at once (ray_calls.get_all)."""
        return get_all([getattr(w, method).remote(*args) for w in self._workers])

    def call_rollouts(self, what: str, method: str, *per_slot_args) -> list:
        """`method` on every rollout actor (with its slot's arguments); a dead actor is replaced and asked again."""
        return self._recovery.on_all(what, method, *per_slot_args)

    def send(self, method: str, jobs: list, fields=None) -> list:
        """`method(job)` on every train rank with its job, through the transport (driver/transport.py): the ranks
        read `fields` of their rows from the store (data plane on) or get them from here (off)."""
        return self._transport.call(self._workers, method, jobs, fields)

    def dispatch(self, jobs: list) -> list:
        """Rollout job i to the rollout actor of slot i; their Ray futures."""
        return [a.generate.remote(j) for a, j in zip(self._rollout, jobs)]

    def wait_rows(self, pid: str, jobs: list, fields, timeout: float) -> list[dict]:
        """Block until the rollout jobs [(rows, future)] of partition `pid` are in the store; their receipts
        (DriverTransport.collect)."""
        return self._transport.collect(pid, jobs, fields, timeout)

    def refit(self, wait: bool = True) -> float:
        """Hand the policy's weights (the run's Progress.version) to the rollout actors, gathered once (rank 0's
        copy): one file in shared memory that every actor maps (shares_weights; on a synchronous one-rank run the
        rank's own parameters, no copy at all), or else one object-store reference every actor reads. wait: block
        until every engine has them and return the slowest engine's load seconds; else they land after the actors'
        batches in flight, and the slowest load confirmed so far is returned (a dead actor is replaced)."""
        now = self._progress
        if self.shares_weights():
            # kept: the versions an open job was sent with (a replacement actor replays the job with them), and,
            # async, those a refit not yet confirmed may still load (its actor's batches before it make the rows of
            # the steps up to `age` ahead, so none older than that is pending)
            overlap = self.cfg.grpo.async_grpo
            age = overlap.max_trajectory_age_steps if overlap.enabled else 0
            pending = set(range(now.version - age, now.version))
            need = sorted({p.version for p in self.rollouts.open.values()} | pending)
            # synchronous, one rank, no job open: no actor generates while the rank trains, so the actors may view
            # the rank's own parameters (a refit without a copy); else each version is a copy of its own
            live = not overlap.enabled and self.cfg.policy.dp_size == 1 and not need
            refs = [w.publish_weights.remote(now.version, need, live) for w in self._workers]
            now.policy_ref = get_all(refs)[0]  # a SharedWeights: the actors map rank 0's file
        else:
            now.policy_ref = self._gathered()
        self._recovery.keep_weights(now.version, now.policy_ref)
        what = f"step {now.version}: refit"
        if not wait:
            now.refits += [(i, a, a.load_weights.remote(now.policy_ref, now.version)) for i, a in enumerate(self._rollout)]
            return self._recovery.settle_refits(what)  # earlier refits' errors surface here
        n = len(self._rollout)
        seconds = max(self.call_rollouts(what, "load_weights", [now.policy_ref] * n, [now.version] * n))
        now.refits[:] = []  # every engine holds these weights now, a replacement's included
        return seconds

    def shares_weights(self) -> bool:
        """Refits go through shared memory (model/shared_weights.py): the Hugging Face engine, whose actors all run
        on train rank 0's node, without in-flight updates (a refit waiting in an engine's slot may outlive its file);
        else rank 0's state dict goes through the object store (vLLM loads its own copy)."""
        nodes = self._nodes.get("train", [])[:1]
        in_flight = self.cfg.grpo.async_grpo.in_flight_weight_updates
        return (self.cfg.generation.backend == "hf" and not in_flight and bool(nodes)
                and set(self._nodes.get("rollout", [])) <= set(nodes))

    def _gathered(self):
        """Rank 0's full state dict, gathered once, as an object-store reference."""
        refs = [w.state_dict.remote() for w in self._workers]  # collective; ranks > 0 return {}
        get_all(refs[1:])  # a dead rank is seen at once, not after the others' collective times out
        return refs[0]

    def policy_state(self) -> dict:
        """The policy's full state dict, here (the run's `policy/` export): the last refit's, or gathered now where
        that refit went through shared memory or none was made."""
        import ray

        ref = self._progress.policy_ref
        return ray.get(ref if isinstance(ref, ray.ObjectRef) else self._gathered())

    def resume_at(self, version: int) -> None:
        """The train ranks hold the weights after step `version` (a checkpoint loaded): the rollout actors get them."""
        self._progress.version = version
        self.refit()

    def rollout_round(self, pid: str, step: int, round_: int, prompts: list, G: int, io: StepIO | None = None,
                      group_offset: int = 0, validation: bool = False) -> list[dict]:
        """Create partition `pid`, have the rollout actors fill it with G samples per prompt; the receipts."""
        return self.rollouts.collect(self.rollouts.send(pid, step, round_, prompts, G, group_offset, validation), io)
