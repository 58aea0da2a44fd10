"""`get_all`: the results of calls to several Ray actors, failing at the first that fails instead of in list order."""

from __future__ import annotations


def get_all(futures: list, timeout: float | None = None) -> list:
    """`ray.get(futures)`, except that the first call to finish with an error raises it at once.

    Why not `ray.get(list)`: it waits for the futures in list order, so when train rank 1 dies while rank 0
    waits for it in a collective, it waits for rank 0 first. A rank killed on a live node closes its
    connections and gloo fails rank 0 at once; a node that vanishes closes nothing, and rank 0 waits out
    gloo's timeout (10 minutes) before the death would be seen. Here every call is checked as it finishes
    (faults/restart.py then kills the ranks left waiting). `timeout` bounds the whole wait (GetTimeoutError)."""
    import time

    import ray

    deadline = None if timeout is None else time.monotonic() + timeout
    pending = list(futures)
    while pending:
        left = None if deadline is None else max(0.0, deadline - time.monotonic())
        done, pending = ray.wait(pending, num_returns=1, timeout=left)
        if not done:
            raise ray.exceptions.GetTimeoutError(f"{len(pending)} of {len(futures)} calls not done after {timeout} s")
        ray.get(done)  # raises that call's error now
    return ray.get(list(futures))
