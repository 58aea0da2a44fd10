"""Calls into Ray every room makes: `init` (a given Ray joined within a bound, else a local one of this process's
own) and `get_all` (the results of calls to several actors, failing at the first that fails, not in list order)."""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import threading

PROBE_S = 5.0  # a TCP connect to a Ray address: refused at once, or dropped by a firewall within this
# Ray quirk: joining an address retries the GCS 20 times (RAY_NUM_REDIS_GET_RETRIES), each waiting up to 30 s
# (py_gcs_connect_timeout_s), so a dead or foreign address held ray.init ~11 minutes; one try is enough once
# the port answered
JOIN_RETRIES_ENV, JOIN_RETRIES = "RAY_gcs_server_port_wait_time_s", "1"


def init(address: str | None, error: type[Exception], fix: str, **options) -> None:
    """ray.init, bounded and never into a cluster by accident. No address: a local Ray of this process's own
    (address="local": plain ray.init() would join whatever /tmp/ray/ray_current_cluster names, even a dead or
    foreign cluster). An address: its port must answer within PROBE_S, and the join tries the GCS once (about
    40 s at most), else `error` names the address, what happened and `fix`. A SIGTERM handler this process set
    (a run's stop signals) stays in place throughout, where ray.init would replace it."""
    import ray

    if address and address != "auto":
        host, _, port = address.rpartition(":")
        try:
            socket.create_connection((host.strip("[]"), int(port)), timeout=PROBE_S).close()
        except (OSError, ValueError) as e:
            why = "not HOST:PORT" if isinstance(e, ValueError) else (e.strerror or type(e).__name__).lower()
            raise error(f"cannot reach Ray at {address} ({why}); {fix}") from None
    joining = {JOIN_RETRIES_ENV: JOIN_RETRIES} if address else {}
    try:
        with _env(joining), keeping_sigterm():
            ray.init(address=address or "local", **options)
    except (ConnectionError, RuntimeError, TimeoutError) as e:
        raise error(f"cannot join Ray at {address or 'a local Ray of its own'} ({str(e).splitlines()[0]}); "
                    f"{fix}") from None


@contextlib.contextmanager
def _env(values: dict[str, str]):
    """os.environ with `values` while the block runs (for the join only: nothing started later inherits them)."""
    saved = {k: os.environ.get(k) for k in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


@contextlib.contextmanager
def keeping_sigterm():
    """Ray quirk: ray.init sets a SIGTERM handler as it starts (sys.exit(15): a run stopped then ended "failed",
    exit 15), and its core worker a C++ one (absl's failure handler: a stack dump, once an abort, exit 134). A
    Python handler this process set stays: Ray's is not installed, and ours is set again over the C++ one."""
    own = signal.getsignal(signal.SIGTERM)
    if not callable(own) or threading.current_thread() is not threading.main_thread():
        yield  # no handler of ours to keep: Ray's stands, as it always did
        return
    import ray._private.utils as ray_utils

    installs = ray_utils.set_sigterm_handler
    ray_utils.set_sigterm_handler = lambda handler: None
    try:
        yield
    finally:
        ray_utils.set_sigterm_handler = installs
        signal.signal(signal.SIGTERM, own)


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
