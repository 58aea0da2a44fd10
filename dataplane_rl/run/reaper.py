"""Nothing a run started outlives it, however it ends (docs/store.md, "Guarantees and limits").

Ray starts gcs_server and raylet as children of the driver, and raylet starts the dashboard and
runtime-env agents. A Ctrl-C inside ray.init can leave those agents running with no one to stop them
(seen in 2 of 13 trials). So the train command makes its process a child subreaper (Linux
PR_SET_CHILD_SUBREAPER): an orphaned descendant is re-parented to it rather than to init, and at exit
every descendant still alive is terminated, then killed, then reaped.

A process that is killed runs no exit code: for the CLI's driver, which leads a process group of its own,
a watchdog (run/watchdog.py) then SIGKILLs what is left of that group.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import subprocess
import sys
import threading
from typing import Iterator

from dataplane_rl.pids import start_time

PR_SET_CHILD_SUBREAPER = 36


def _become_subreaper() -> bool:
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        return libc.prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) == 0
    except (OSError, AttributeError):
        return False


def _descendants() -> list:
    import psutil

    return psutil.Process().children(recursive=True)


def _key(p) -> tuple[int, float] | None:
    """A process by (PID, start time since boot): a PID reused by a newer process is another process (not
    psutil's create_time, which a step of the wall clock moves)."""
    started = start_time(p.pid)
    return None if started is None else (p.pid, started)


def reap_descendants(grace_s: float = 5.0, keep: frozenset = frozenset()) -> list[int]:
    """Terminate every live descendant of this process but those in `keep` ((PID, start time) pairs) (kill
    those that do not exit in `grace_s`) and reap them; returns their PIDs."""
    import psutil

    procs = [p for p in _descendants() if _key(p) not in keep]
    for p in procs:
        with contextlib.suppress(psutil.Error):
            p.terminate()
    _, alive = psutil.wait_procs(procs, timeout=grace_s)
    for p in alive:
        with contextlib.suppress(psutil.Error):
            p.kill()
    psutil.wait_procs(alive, timeout=grace_s)
    return [p.pid for p in procs]


_watch_fd: int | None = None  # the write end of the watchdog's pipe: open as long as this process lives


def start_watchdog() -> bool:
    """When this process leads a session of its own (the CLI's driver, run/supervise.py), its process group
    holds only what it started: a watchdog in that group SIGKILLs the group once this process is gone, even
    by SIGKILL. Elsewhere (a shell's job, a pipeline with `tee`) the group is not the run's alone, and
    nothing is started. Returns whether one was started."""
    global _watch_fd
    if _watch_fd is not None or not sys.platform.startswith("linux") or os.getsid(0) != os.getpid():
        return False
    read, write = os.pipe()  # both close on exec: only the watchdog gets `read`, no child of this one `write`
    try:
        subprocess.Popen([sys.executable, "-m", "dataplane_rl.run.watchdog", str(read)], pass_fds=(read,),
                         stdin=subprocess.DEVNULL)
    except OSError:
        os.close(write)
        return False
    finally:
        os.close(read)
    _watch_fd = write
    return True


@contextlib.contextmanager
def owns_descendants() -> Iterator[None]:
    """For a process that is the run (the CLI): on the way out, however it leaves, reap what it started.
    Processes that were already its descendants on the way in are not the run's and stay (a program that
    calls the CLI's main() in-process, with a Ray or a Mooncake store of its own: reaping them would take its
    Ray down, and with it, at Ray's core worker's exit, the program). A Ctrl-C during the reaping itself is
    held back until it is done."""
    before = frozenset(k for k in map(_key, _descendants()) if k is not None)
    _become_subreaper()
    start_watchdog()
    try:
        yield
    finally:
        with deferred_sigint():
            reap_descendants(keep=before)


@contextlib.contextmanager
def deferred_sigint() -> Iterator[None]:
    """Hold back Ctrl-C while the block runs (shutdown must finish); raise it once the block is done."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    caught: list[int] = []
    previous = signal.signal(signal.SIGINT, lambda signum, frame: caught.append(signum))
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)
    if caught and previous is not signal.SIG_IGN:
        raise KeyboardInterrupt
