"""A process's torch, numpy and Python random state as a torch Stateful of plain lists."""

from __future__ import annotations

import random

import numpy as np
import torch
from torch.distributed.checkpoint.stateful import Stateful


class RNGState(Stateful):
    """This process's torch, numpy and Python RNG states, as plain lists: JSON for the driver and the
    rollout actors, weights_only-loadable items in DCP for the train ranks."""

    def state_dict(self) -> dict:
        name, keys, pos, has_gauss, gauss = np.random.get_state()
        version, internal, gauss_next = random.getstate()
        return {"torch": torch.get_rng_state().tolist(),
                "numpy": [name, keys.tolist(), int(pos), int(has_gauss), float(gauss)],
                "python": [version, list(internal), gauss_next]}

    def load_state_dict(self, state: dict) -> None:
        torch.set_rng_state(torch.tensor(state["torch"], dtype=torch.uint8))
        name, keys, pos, has_gauss, gauss = state["numpy"]
        np.random.set_state((name, np.array(keys, dtype=np.uint32), pos, has_gauss, gauss))
        version, internal, gauss_next = state["python"]
        random.setstate((version, tuple(internal), gauss_next))
