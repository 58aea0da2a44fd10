"""SIGTERM / SIGHUP / SIGINT: finish the current step, checkpoint, stop cleanly (clusters preempt with SIGTERM;
a closed terminal or ssh session sends SIGHUP, which once ended the run at once with no summary).

The first signal only sets a flag that the loop reads between steps; a second SIGINT raises
KeyboardInterrupt at once, for a user who does not want to wait for the step. While the run starts (Ray,
the store, the actors: tens of seconds on a busy machine) there is no step to finish, so the first signal
abandons the start at once (StartInterrupted) and the run ends 'interrupted' all the same. A SIGINT or
SIGHUP that this process inherited as ignored (started with `&` or `nohup`) stays ignored; SIGTERM always
stops the run.

A SIGTERM to the whole process group (`timeout`, `kill -- -PGID`, SLURM's scancel, a pod stop) reaches
Ray's gcs_server, raylet and actors too: they exit at once, the step can never finish, and the driver's
ray.get would wait 60 s for the GCS before Ray terminates the process. So on SIGTERM a thread watches (for
up to 10 s) the Ray processes this driver started; if they go, it raises RayLost in the main thread at
once, and the run stops without talking to Ray again.
"""

from __future__ import annotations

import _thread
import contextlib
import signal
import threading
import time

# Ray's processes exit within a fraction of a second of a SIGTERM (seen: 0.1-2 s on a loaded 2-core
# machine); a driver-only SIGTERM leaves them running, and then this bounds the watcher's look
_RAY_EXIT_WAIT_S = 10.0


# set once a run in this process lost Ray to a group signal: its core worker cannot be shut down cleanly
LOST = threading.Event()


# signals whose default action ends a process: one sent to the whole group also stops Ray's processes
TERMINATING = (signal.SIGTERM, signal.SIGHUP)


class RayLost(BaseException):
    """Ray's own processes were stopped with the driver (a signal to the whole process group): nothing
    that needs Ray can be done any more. A BaseException, so no `except Exception` on the way swallows it."""


def _going(procs: list) -> bool:
    import psutil

    for p in procs:
        try:
            if p.status() == psutil.STATUS_ZOMBIE:
                return True
        except psutil.NoSuchProcess:
            return True
    return False


def _ray_processes() -> list:
    """The Ray processes under this driver that live as long as the run: gcs_server, raylet, the actors
    and agents (idle workers come and go)."""
    import psutil

    out = []
    with contextlib.suppress(psutil.Error):
        for p in psutil.Process().children(recursive=True):
            with contextlib.suppress(psutil.Error):
                title = (p.cmdline() or [""])[0]
                if p.name() in ("gcs_server", "raylet") or (title.startswith("ray::") and not title.startswith("ray::IDLE")):
                    out.append(p)
    return out


class StartInterrupted(KeyboardInterrupt):
    """A stop signal while the run was starting: nothing to finish or save, so the start is abandoned at once.
    A KeyboardInterrupt: Ray's waits (ray.get, ray.init) end on that one only (any other exception raised by a
    handler inside them becomes a SystemError), and hand on a KeyboardInterrupt of their own, so the run asks
    StopSignals.abandoned, not the exception's type."""

    def __init__(self, signum: int) -> None:
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


class StopSignals:
    def __init__(self) -> None:
        self.signum: int | None = None
        self.starting = False  # inside starting_up(): the first signal raises StartInterrupted
        self.abandoned = False  # the start was abandoned for a stop signal
        self._saved: dict[int, object] = {}
        self.ray_lost = False
        self._ray_gone = False
        self._procs: list = []  # Ray's processes that live as long as the run, when this process started Ray

    @property
    def requested(self) -> bool:
        return self.signum is not None

    def _handle(self, signum, frame) -> None:
        if self._ray_gone:  # the watcher's call: Ray is gone, leave whatever waits on it
            self._ray_gone = False
            if not self.ray_lost:  # not already being handled (an actor's death may have been seen first)
                self.ray_lost = True
                raise RayLost
            return
        if self.signum is not None and signum == signal.SIGINT:
            raise KeyboardInterrupt
        first = self.signum is None
        self.signum = signum
        if first and self.starting:
            self.starting, self.abandoned = False, True
            raise StartInterrupted(signum)
        if signum in TERMINATING and first and self._procs:
            # the main thread may be inside ray.get: look from another thread, so the handler returns at once
            threading.Thread(target=self._watch, name="ray-lost-watch", daemon=True).start()

    def _watch(self) -> None:
        # not once the run has seen it itself, nor after the handlers are restored (Ray's would sys.exit(1))
        if self.ray_going(_RAY_EXIT_WAIT_S) and self._saved and not self.ray_lost:
            self._ray_gone = True
            _thread.interrupt_main(signal.SIGTERM)  # runs _handle in the main thread, which raises RayLost

    def ray_going(self, wait_s: float = 2.0) -> bool:
        """Whether Ray's processes under this driver  start exiting within `wait_s`."""
        deadline = time.monotonic() + wait_s
        while self._procs and not _going(self._procs):
            if time.monotonic() > deadline:
                return False  # only the driver was signalled: the step finishes, as for SIGINT
            time.sleep(0.05)
        return bool(self._procs)

    @contextlib.contextmanager
    def starting_up(self):
        """The run's start: a stop signal within it (or already received) raises StartInterrupted at once."""
        if self.requested:
            self.abandoned = True
            raise StartInterrupted(self.signum)
        self.starting = True
        try:
            yield
        finally:
            self.starting = False

    def watch_ray(self) -> None:
        """Remember Ray's processes under this driver, once its actors are up; none when it joined a cluster
        (cluster.address), whose processes a signal to this job does not reach."""
        self._procs = _ray_processes()

    def install(self) -> None:
        """(Re)install the handlers; call again after ray.init, which sets its own SIGTERM handler."""
        if threading.current_thread() is not threading.main_thread():
            return  # signals reach the main thread only; a run in a thread stops by its caller
        for sig in (signal.SIGTERM, signal.SIGHUP, signal.SIGINT):
            current = signal.getsignal(sig)
            if sig != signal.SIGTERM and current == signal.SIG_IGN and sig not in self._saved:
                continue  # `nohup` and `&` ignore them on purpose
            self._saved.setdefault(sig, current)
            signal.signal(sig, self._handle)

    def __enter__(self) -> "StopSignals":
        self.install()
        return self

    def __exit__(self, *exc) -> None:
        for sig, handler in self._saved.items():
            signal.signal(sig, handler)
        self._saved.clear()
