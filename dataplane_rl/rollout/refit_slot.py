"""The slot through which a refit reaches an engine while it generates (grpo.async_grpo.in_flight_weight_updates).

Both engines (rollout/engine.py's HFEngine, rollout/vllm_engine.py's VLLMEngine) hold one. The refit arrives on
the rollout actor's refit thread (its own Ray concurrency group, rollout/worker.py) and calls `offer`; the
generating thread calls `land` between two decode steps. A refit offered between generations loads at once.
"""

from __future__ import annotations

import threading
from contextlib import contextmanager
from typing import Callable

from dataplane_rl import trace


class RefitSlot:
    """The loaded weights' version and at most one parked refit. `load(state_dict)` puts weights into the engine;
    it runs on whichever thread holds the lock: the refit thread between generations, the generating thread
    inside one (a newer refit replaces a parked one that has not landed)."""

    def __init__(self, load: Callable[[dict], None]) -> None:
        self.load = load
        self.version = 0  # the loaded weights' version, recorded on every sampled token
        self.in_flight_refits = 0  # refits loaded while a generation was under way
        self._lock = threading.Condition()  # guards _pending, _generating and version against the refit thread
        self._pending: tuple | None = None  # (state_dict, version) offered during a generation, not yet loaded
        self._generating = False

    def offer(self, state_dict: dict, version: int) -> bool:
        """A refit from another thread: loaded at once between generations (True), else parked for the decode
        loop's next step (False)."""
        with self._lock:
            if not self._generating:
                self.load(state_dict)
                self.version = version
                self._lock.notify_all()  # a job waiting for these weights (wait_for_version)
                return True
            self._pending = (state_dict, version)
            return False

    def wait_for_version(self, version: int, timeout_s: float) -> bool:
        """Block until the loaded weights are at least `version` (a refit sent before a job can reach the actor's
        refit thread after the job reached its generate thread); False after timeout_s."""
        with self._lock:
            return self._lock.wait_for(lambda: self.version >= version, timeout=timeout_s)

    def land(self, inside: bool = True) -> bool:
        """Load the parked refit, if any; True when the weights changed. Called by the generating thread only.
        inside: between two decode steps, so later tokens use it (counted in in_flight_refits, traced)."""
        if self._pending is None:  # only offer() sets it, and only this thread clears it: no lock to look
            return False
        with self._lock, trace.span("refit_in_generation" if inside else "refit_after_generation",
                                    version=self._pending[1]):  # where it landed, in the trace
            state_dict, version = self._pending
            self._pending = None
            self.load(state_dict)
            self.version = version
            self.in_flight_refits += inside
            self._lock.notify_all()
        return True

    @contextmanager
    def generating(self):
        """The span of one generation: refits offered inside it park; one that arrived too late for any token
        lands when it ends, so the next generation uses it."""
        with self._lock:
            self._generating = True
        try:
            yield
        finally:
            self.land(inside=False)
            with self._lock:
                self._generating = False
