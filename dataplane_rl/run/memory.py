"""Each process's peak memory over a run, for summary.json's `memory` (docs/run-folder.md).

The driver samples itself, its supervisor (run/supervise.py, its parent under `dataplane-rl train`), its
descendants (the Ray the run started: gcs_server, raylet, its agents and workers, the rollout actors and train
ranks among them; the master and holders of a Mooncake store the run started) and the actors the run names on
this host (on a joined cluster they are not the driver's descendants, and the cluster's Ray is not the run's).
A process's memory is its PSS (proportional set size: a page shared by k processes counts 1/k in each, so a sum
over the processes counts every shared page once: the shm store's pages, the libraries' code), read through
psutil's memory_full_info (Linux's /proc/PID/smaps_rollup); where that cannot be read, its RSS, and its entry
says so.
PSS has no kernel high-water mark, so its peak is the largest sample, taken every `every_s` seconds on a thread
of the driver and once more before the actors stop; the kernel's exact peak RSS (VmHWM, which counts a shared
page in every process that touched it) is kept beside it. Reading a process's PSS walks its page tables (about
10 ms for a 500 MB process on a busy 2-core machine), so the period stretches to 20 times a sample's own time:
sampling takes at most about 5% of one core.
"""

from __future__ import annotations

import contextlib
import os
import threading
import time
from typing import Callable

from dataplane_rl.pids import start_time

MB = 2**20
BUSY_SHARE = 20  # the period between samples is at least this many times a sample's own duration
SUPERVISOR = "dataplane_rl.run.supervise"  # the module `dataplane-rl train` runs the driver under


def peak_rss(pid: int) -> int | None:
    """The kernel's high-water mark of a process's resident memory (VmHWM), in bytes; None where unreadable."""
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def command(p) -> str:
    """A process named by its command: Ray's process title (ray::IDLE), a program's name (raylet), or a Python
    script's (python agent.py)."""
    cmd = p.cmdline()
    if not cmd:
        return p.name()
    first = cmd[0].split(" ")[0]  # Ray's titles (ray::IDLE) may hold spaces in one argument
    first = first if first.startswith("ray::") else os.path.basename(first)
    if first.startswith("python"):
        script = next((c for c in cmd[1:] if not c.startswith("-")), "")
        return f"{first} {os.path.basename(script)}".strip()
    return first


class PeakMemory:
    """The peaks of a run's processes: `sample()` once, or every `every_s` seconds between `start()` and `stop()`.
    `roles()`: {PID: role} of the processes the run names (train-rank-R, rollout-I); the driver is `driver`, its
    supervisor `supervisor`, any other process is named by its command."""

    def __init__(self, roles: Callable[[], dict[int, str]], every_s: float = 1.0) -> None:
        self.roles, self.every_s = roles, every_s
        self.procs: dict[tuple[int, float], dict] = {}  # (PID, start since boot): a reused PID is another process
        self.peak_total = 0  # the largest sum of one sample over every process, bytes
        self.samples = 0
        self._lock = threading.Lock()
        self._done = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        def loop() -> None:
            took = 0.0
            while not self._done.wait(max(self.every_s, BUSY_SHARE * took)):
                t0 = time.monotonic()
                with contextlib.suppress(Exception):  # a sample is an observation: it never stops the run
                    self.sample()
                took = time.monotonic() - t0

        self._thread = threading.Thread(target=loop, name="peak-memory", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        """Stop sampling, after one last sample (while the actors still live); nothing if it never started."""
        if self._thread is None:
            return
        self._done.set()
        self._thread.join(timeout=10)
        self._thread = None
        with contextlib.suppress(Exception):
            self.sample()

    def sample(self) -> None:
        import psutil

        roles = {**self.roles(), os.getpid(): "driver"}
        me = psutil.Process()
        procs = {me.pid: me}
        with contextlib.suppress(psutil.Error):
            parent = me.parent()
            if parent is not None and SUPERVISOR in parent.cmdline():
                procs[parent.pid], roles[parent.pid] = parent, "supervisor"
        with contextlib.suppress(psutil.Error):
            procs.update((p.pid, p) for p in me.children(recursive=True))
        for pid in roles.keys() - procs.keys():
            with contextlib.suppress(psutil.Error):
                procs[pid] = psutil.Process(pid)
        seen = []
        for pid, p in procs.items():
            started = start_time(pid)
            if started is None:
                continue
            try:
                with p.oneshot():
                    try:
                        now, measure = p.memory_full_info().pss, "pss"
                    except (psutil.AccessDenied, AttributeError):  # no smaps_rollup to read, or not Linux
                        now, measure = p.memory_info().rss, "rss"
                    name = roles.get(pid) or command(p)
            except psutil.Error:  # it exited meanwhile
                continue
            seen.append(((pid, started), name, measure, now, peak_rss(pid)))
        with self._lock:
            for key, name, measure, now, hwm in seen:
                e = self.procs.setdefault(key, {"role": name, "pid": key[0], "measure": measure, "peak": 0})
                e["role"] = name if key[0] in roles else e["role"]  # an actor may be seen before it is named
                e["measure"] = "rss" if "rss" in (measure, e["measure"]) else "pss"
                e["peak"] = max(e["peak"], now)
                if hwm is not None:
                    e["peak_rss"] = max(e.get("peak_rss", 0), hwm)
            self.peak_total = max(self.peak_total, sum(now for _, _, _, now, _ in seen))
            self.samples += 1

    def summary(self) -> dict:
        """summary.json's `memory`: each process's peak (MiB; `measure` pss, or rss where PSS was unreadable) and
        kernel peak RSS, the sum of the peaks, and the largest sum at one sample."""
        with self._lock:
            procs = sorted(self.procs.values(), key=lambda e: (e["role"] != "driver", e["role"], e["pid"]))
            rows = [{"role": e["role"], "pid": e["pid"], "measure": e["measure"], "peak_mb": round(e["peak"] / MB, 1),
                     "peak_rss_mb": round(e["peak_rss"] / MB, 1) if "peak_rss" in e else None} for e in procs]
            measure = "pss" if all(e["measure"] == "pss" for e in procs) else "pss and rss"
            return {"measure": measure, "sum_peak_mb": round(sum(e["peak"] for e in procs) / MB, 1),
                    "peak_total_mb": round(self.peak_total / MB, 1), "samples": self.samples,
                    "every_s": self.every_s, "processes": rows}
