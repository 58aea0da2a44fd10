"""A run: its folder, its loggers, the Ray it owns and its fault ledger; it outlives every Fleet of its processes.

An in-run resume (faults/restart.py) closes one Fleet and starts another; the Run, and with it Ray and the
ledger of the faults survived, stays. `driver/loop.py` makes one Run per `train`.
"""

from __future__ import annotations

import sys
import threading

from dataplane_rl.errors import ConfigError
from dataplane_rl.ray_calls import init
from dataplane_rl.run import private_ray
from dataplane_rl.run.ledger import FaultLedger


# the most seconds a shutdown of a Ray whose start was interrupted may take; past it the run goes on without it
INTERRUPTED_SHUTDOWN_S = 30.0


class RayOwner:
    """Ray for the run: joined if running, else started here (private to this user unless cluster.address
    names a cluster) and shut down by `stop`."""

    def __init__(self) -> None:
        self.started = False  # this process started Ray, so stop() shuts it down
        self.interrupted = False  # ray.init ended part-way (a stop signal or its error): Ray may be half-built
        self.lost = False  # Ray's processes were stopped under us (a SIGTERM to the group): wait on nothing of it
        self.unprivate = None  # undoes private_ray.make_private once Ray is shut down

    def start(self, cfg) -> None:
        import ray

        if ray.is_initialized():
            return
        if not cfg.cluster.address:
            self.unprivate = private_ray.make_private()
        # set first: a Ctrl-C inside ray.init must still shut down what it started (stop())
        self.started = True
        # the run's own local Ray, never one /tmp/ray/ray_current_cluster names; a cluster.address joined within a
        # bound; the run's stop signals kept in place while Ray starts (ray_calls.init)
        try:
            init(cfg.cluster.address, ConfigError, "check cluster.address (the address `ray start --head` printed), "
                 "or leave it unset for a local Ray of the run's own", include_dashboard=cfg.cluster.include_dashboard,
                 num_cpus=cfg.cluster.num_cpus if not cfg.cluster.address else None, logging_level="WARNING",
                 log_to_driver=True)
        except BaseException:
            self.interrupted = True  # a Ctrl-C (or a stop signal's StartInterrupted) inside ray.init, or its error
            raise
        private_ray.stop_unused(cfg)  # Ray's dashboard and monitor, which nothing of the run uses
        # after the join: ray.init(address="auto") turns token auth on when it finds the user's token
        for line in (private_ray.open_warning(cfg), private_ray.security_line(cfg)):
            if line:
                print(line, file=sys.stderr)

    def mark_lost(self) -> None:
        """Ray's processes were stopped under us (a SIGTERM to the process group): stop() waits on nothing of Ray."""
        self.lost = True

    def stop(self) -> None:
        import ray

        if self.started and self.lost:
            # ray.shutdown (and Ray's own atexit call of it) would block ~20-60 s in the core
            # worker's goodbye to a dead raylet; the CLI's reaper stops what is left of Ray
            import atexit

            atexit.unregister(ray.shutdown)
            self.started = False
        elif self.started and self.interrupted:
            self._bounded_shutdown()
        elif self.started:
            ray.shutdown()
            self.started = False
        if self.unprivate is not None:
            self.unprivate()
            self.unprivate = None

    def _bounded_shutdown(self) -> None:
        """ray.shutdown after a start that a signal or an error ended part-way, on a thread, for at most
        INTERRUPTED_SHUTDOWN_S: Ray's half-built state (a core worker never connected, a node still starting its
        processes) can leave the shutdown waiting on something that never comes. Past the bound the run goes on to
        its exit, where the CLI's reaper (run/reaper.py) stops every process Ray started."""
        import atexit

        import ray

        done = threading.Thread(target=ray.shutdown, name="ray-shutdown", daemon=True)
        done.start()
        done.join(INTERRUPTED_SHUTDOWN_S)
        if done.is_alive():
            atexit.unregister(ray.shutdown)  # Ray's own call at exit would wait on the same thing
            print(f"Ray's shutdown after its interrupted start did not end within {INTERRUPTED_SHUTDOWN_S:.0f} s; "
                  "the processes it started are stopped at exit", file=sys.stderr)
        self.started = False


class Run:
    """What one `train` owns beyond its processes: the folder (run/folder.py RunDir), the loggers once the run
    has started, the Ray it owns and the fault ledger (run/ledger.py)."""

    def __init__(self, folder) -> None:
        self.folder = folder
        self.path = folder.path
        self.loggers = None
        self.ray = RayOwner()
        self.ledger = FaultLedger()

    def open_loggers(self, cfg) -> None:
        from dataplane_rl.run.loggers import MetricLoggers

        self.loggers = MetricLoggers(cfg.logger, self.path, cfg.model_dump(mode="json", by_alias=True))

    def close_loggers(self) -> None:
        if self.loggers is not None:
            self.loggers.close()
