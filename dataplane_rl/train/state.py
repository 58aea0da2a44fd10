"""What a train rank saves in a checkpoint and loads back, resharded, through torch.distributed.checkpoint."""

from __future__ import annotations

from pathlib import Path

import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.checkpoint.stateful import Stateful

from dataplane_rl.checkpoint.files import dcp_load, read_dcp_metadata
from dataplane_rl.rng import RNGState


class PolicyState(Stateful):
    """The sharded model and its optimizer, as DTensor shards (each rank saves and loads its own)."""

    def __init__(self, model, optimizer) -> None:
        self.model, self.optimizer = model, optimizer

    def state_dict(self) -> dict:
        model_sd, optim_sd = get_state_dict(self.model, self.optimizer)
        return {"model": model_sd, "optim": optim_sd}

    def load_state_dict(self, state: dict) -> None:
        set_state_dict(self.model, self.optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"])


def worker_states(worker, saved: set[str] | None = None) -> dict[str, Stateful]:
    """What a train rank saves. RNG keys carry the rank: DCP writes a non-sharded value once per key.
    saved: the checkpoint's top-level keys, on load; a rank the saving run did not have keeps its seeded
    RNG (training draws no random numbers: the RNG is saved for a future dropout, not for today's numbers)."""
    states: dict[str, Stateful] = {"policy": PolicyState(worker.model, worker.opt)}
    rng = f"rng_rank{worker.rank}"
    if saved is None or rng in saved:
        states[rng] = RNGState()
    if getattr(worker, "scheduler", None) is not None:  # a torch LRScheduler is already Stateful
        states["scheduler"] = worker.scheduler
    return states


def save_worker(worker, path: str) -> None:
    dcp.save(worker_states(worker), checkpoint_id=path)  # collective: every rank writes its shards


def load_worker(worker, path: str) -> None:
    """Collective: DCP reshards the saved DTensors for this run's ranks, whatever their number was."""
    saved = {k.split(".", 1)[0] for k in read_dcp_metadata(Path(path)).state_dict_metadata}
    dcp_load(worker_states(worker, saved), Path(path))
