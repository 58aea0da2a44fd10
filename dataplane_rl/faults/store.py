"""Whether a store error means the run's own Mooncake store lost a process (faults/restart.py, driver/step.py);
the store answers through its protocol (`dead_processes`, store/base.py)."""

from __future__ import annotations

import time

from dataplane_rl.errors import StoreUnavailableError

DEATH_SHOWS_S = 5.0  # a store error's holder: how long its exit may take to show (SIGKILLed under load: ms)


def store_error(e: BaseException | None) -> bool:
    """Whether `e`, or an error it carries (a Ray task's cause, a __cause__), is the store's."""
    seen = 0
    while e is not None and seen < 8:
        if isinstance(e, StoreUnavailableError):
            return True
        e, seen = getattr(e, "cause", None) or e.__cause__ or e.__context__, seen + 1
    return False


def dead_store(store, e: BaseException | None) -> list[str]:
    """The dead processes of the run's own Mooncake store (empty: none, or a store the run joined). A read or write
    can fail on a holder's closed connection a moment before the holder's exit shows: after a store error the
    processes are polled for up to DEATH_SHOWS_S more."""
    dead = store.dead_processes()
    if dead is None:
        return []
    deadline = time.monotonic() + DEATH_SHOWS_S
    while not dead and store_error(e) and time.monotonic() < deadline:
        time.sleep(0.05)
        dead = store.dead_processes()
    return dead
