"""Distributed checkpoints: one manager decides what is saved, as `Stateful` objects (STYLE §13).

A checkpoint is a folder RUN_DIR/checkpoints/step_NNNNNN/ holding
  train/        torch.distributed.checkpoint: each train rank writes its own model/optimizer shards and RNG
  driver/       the driver's state (step, prompt cursor, its RNG and every rollout actor's RNG)
  config.yaml   the run's resolved config
It is written under a hidden temporary name and renamed when complete, so a crash during a save leaves
the previous checkpoint the latest one; a leftover temporary folder is removed by the next save.
"""

from __future__ import annotations

import contextlib
import os
import random
import re
import shutil
import warnings
from pathlib import Path

import numpy as np
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.checkpoint.stateful import Stateful

from dataplane_rl.errors import ConfigError

_NAME = re.compile(r"^step_(\d{6,})$")


class PolicyState(Stateful):
    """The sharded model and its optimizer, as DTensor shards (each rank saves and loads its own)."""

    def __init__(self, model, optimizer) -> None:
        self.model, self.optimizer = model, optimizer

    def state_dict(self) -> dict:
        model_sd, optim_sd = get_state_dict(self.model, self.optimizer)
        return {"model": model_sd, "optim": optim_sd}

    def load_state_dict(self, state: dict) -> None:
        set_state_dict(self.model, self.optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"])


class RNGState(Stateful):
    """This process's torch, numpy and Python RNG states."""

    def state_dict(self) -> dict:
        return {"torch": torch.get_rng_state(), "numpy": np.random.get_state(), "python": random.getstate()}

    def load_state_dict(self, state: dict) -> None:
        torch.set_rng_state(state["torch"])
        np.random.set_state(state["numpy"])
        random.setstate(state["python"])


class ValueState(Stateful):
    """Plain values (the step, the rollout actors' RNG states) restored into a dict the caller reads."""

    def __init__(self, values: dict) -> None:
        self.values = values

    def state_dict(self) -> dict:
        return dict(self.values)

    def load_state_dict(self, state: dict) -> None:
        self.values.update(state)


def worker_states(worker) -> dict[str, Stateful]:
    """What a train rank saves. RNG keys carry the rank: DCP writes a non-sharded value once per key."""
    states: dict[str, Stateful] = {"policy": PolicyState(worker.model, worker.opt),
                                   f"rng_rank{worker.rank}": RNGState()}
    if getattr(worker, "scheduler", None) is not None:  # a torch LRScheduler is already Stateful
        states["scheduler"] = worker.scheduler
    return states


def save_worker(worker, path: str) -> None:
    dcp.save(worker_states(worker), checkpoint_id=path)  # collective: every rank writes its shards


def load_worker(worker, path: str) -> None:
    dcp.load(worker_states(worker), checkpoint_id=path)


@contextlib.contextmanager
def single_process():
    """The driver is in no process group: DCP warns on every no_dist call that it assumes one process."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled", category=UserWarning)
        yield


def step_of(path: Path) -> int:
    return int(_NAME.match(path.name).group(1))


class CheckpointManager:
    """Saves, finds and prunes the checkpoints of one run; the driver calls it between steps."""

    def __init__(self, root: str | Path, keep_top_k: int | None = None) -> None:
        # absolute: the train workers write their shards from their own working directory (Ray's), so a
        # relative logger.run_dir would put them somewhere the driver never looks
        self.root = Path(root).absolute()
        self.keep_top_k = keep_top_k

    @classmethod
    def for_config(cls, cfg) -> "CheckpointManager":
        c = cfg.checkpointing
        return cls(c.checkpoint_dir or Path(cfg.logger.run_dir) / "checkpoints", c.keep_top_k)

    def all(self) -> list[Path]:
        """Complete checkpoints, oldest first (temporary folders never match the name)."""
        if not self.root.is_dir():
            return []
        return sorted((p for p in self.root.iterdir() if _NAME.match(p.name) and p.is_dir()), key=step_of)

    def find(self, step: int | None = None) -> Path:
        done = self.all()
        if not done:
            raise ConfigError(f"no complete checkpoint in {self.root}; the run saved none (checkpointing.enabled "
                              "was false, or it died before checkpointing.save_period steps)")
        if step is None:
            return done[-1]
        for p in done:
            if step_of(p) == step:
                return p
        raise ConfigError(f"no checkpoint of step {step} in {self.root}; have steps {[step_of(p) for p in done]}")

    def save(self, trainer, step: int, config_yaml: str) -> Path:
        import ray

        self.root.mkdir(parents=True, exist_ok=True)
        for stale in self.root.glob(".step_*.tmp"):  # what a crashed save left behind
            shutil.rmtree(stale, ignore_errors=True)
        final = self.root / f"step_{step:06d}"
        tmp = self.root / f".{final.name}.tmp"
        ray.get([w.save_checkpoint.remote(str(tmp / "train")) for w in trainer.workers])
        with single_process():
            dcp.save(self.driver_states(trainer, step)[0], checkpoint_id=str(tmp / "driver"), no_dist=True)
        (tmp / "config.yaml").write_text(config_yaml)
        if final.exists():  # a resumed run saving a step again
            shutil.rmtree(final)
        os.replace(tmp, final)  # the checkpoint appears whole or not at all
        self.prune()
        return final

    def load(self, trainer, path: Path) -> int:
        """Restore every process from `path`; returns its step. The caller refits the rollout actors."""
        import ray

        ray.get([w.load_checkpoint.remote(str(path / "train")) for w in trainer.workers])
        states, values = self.driver_states(trainer, 0)  # the current values give dcp.load the shapes
        with single_process():
            dcp.load(states, checkpoint_id=str(path / "driver"), no_dist=True)
        ray.get([a.set_rng_state.remote(s) for a, s in zip(trainer.rollout, values["rollout_rng"])])
        return int(values["step"])

    @staticmethod
    def driver_states(trainer, step: int) -> tuple[dict[str, Stateful], dict]:
        """What the driver saves, and the dict a load fills. Prompts are a function of (seed, step, round),
        so the step is the whole prompt cursor; generation is seeded per sample, the actors' RNG is saved
        anyway so nothing a future engine draws is lost."""
        import ray

        values = {"step": step, "rollout_rng": ray.get([a.rng_state.remote() for a in trainer.rollout])}
        return {"driver": ValueState(values), "driver_rng": RNGState()}, values

    def prune(self) -> None:
        if self.keep_top_k is None:
            return
        for old in self.all()[:-self.keep_top_k]:
            shutil.rmtree(old, ignore_errors=True)
