"""Peak memory of a process and every process below it, sampled in a thread while it runs.

Each sample walks the root's children recursively (a run's Ray workers are the raylet's children, which is the
driver's) and sums each process's PSS, its proportional set size: a page shared by k processes counts 1/k in each,
so the shared libraries, the model weights a forked worker inherits and a mapped store file are counted once in the
sum. PSS comes from /proc/PID/smaps_rollup (psutil `memory_full_info`); where a process's cannot be read (another
user's process, a kernel without it) the whole run falls back to RSS, which counts shared pages once per process,
and says so: `kind` is "pss" or "rss".

Reading a process's PSS walks its page tables: one sample of a SmolLM2 run's tree (train rank ~4 GB, rollout actor,
driver, Ray's processes) took ~120 ms of CPU on the 2-core machine, so a fixed 0.2 s period would take over a third
of a core from the run it measures (its steps were ~30% slower sampled so). As the run's own sampler does
(run/memory.py), the period stretches to BUSY_SHARE times a sample's own time: at most ~5% of one core, the same
rule for every run a benchmark compares.
"""

from __future__ import annotations

import os
import threading
import time

import psutil

from dataplane_rl.run.memory import BUSY_SHARE


class TreeMemory:
    """Sample the memory of `pid`'s process tree every `interval` seconds, or BUSY_SHARE times a sample's own
    duration where that is longer, until stop(); a context manager."""

    def __init__(self, pid: int, interval: float = 0.2) -> None:
        self.root = psutil.Process(pid)
        self.interval = interval
        self.kind = "pss"
        self.peak_bytes = 0
        self.peak_processes = 0
        self.at_peak: list[dict] = []  # each process's share of the peak, largest first
        self.samples = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"tree-memory-{pid}", daemon=True)

    def __enter__(self) -> TreeMemory:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    def stop(self) -> dict:
        """Stop sampling (one last sample first) and return the result."""
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=10 * self.interval + 5)
        return self.result()

    def result(self) -> dict:
        return {"peak_mb": self.peak_bytes / 2**20, "kind": self.kind, "processes_at_peak": self.peak_processes,
                "at_peak": self.at_peak, "samples": self.samples}

    def _run(self) -> None:
        while True:
            t0 = time.monotonic()
            self.sample()
            if self._stop.wait(max(self.interval, BUSY_SHARE * (time.monotonic() - t0))):
                self.sample()
                return

    def sample(self) -> int:
        """One walk of the tree: the summed memory now (also kept as the peak when it is the largest yet)."""
        try:
            procs = [self.root, *self.root.children(recursive=True)]
        except psutil.Error:  # the root has exited: nothing left to count
            return 0
        kind = self.kind
        sizes = self._sizes(procs)
        if self.kind != kind:  # fell back to RSS part-way: count this sample again, all by RSS
            sizes = self._sizes(procs)
        total = sum(b for _, b in sizes)
        self.samples += 1
        if total > self.peak_bytes:
            self.peak_bytes, self.peak_processes = total, len(sizes)
            self.at_peak = sorted(({"process": label(p), "pid": p.pid, "mb": b / 2**20} for p, b in sizes),
                                  key=lambda x: -x["mb"])
        return total

    def _sizes(self, procs: list[psutil.Process]) -> list[tuple[psutil.Process, int]]:
        out = []
        for p in procs:
            try:
                out.append((p, self._memory(p)))
            except psutil.NoSuchProcess:
                pass  # exited between the listing and the read
        return out

    def _memory(self, p: psutil.Process) -> int:
        if self.kind == "pss":
            try:
                pss = getattr(p.memory_full_info(), "pss", None)
            except psutil.AccessDenied:
                pss = None
            if pss is not None:
                return pss
            # one unreadable PSS would make the sum mix measures: count every process by RSS from here on
            self.kind, self.peak_bytes, self.peak_processes = "rss", 0, 0
        return p.memory_info().rss


def label(p: psutil.Process) -> str:
    """A short name: a Ray worker's title (ray::Class), the module of `python -m`, else the program's name."""
    try:
        cmd = p.cmdline()
    except psutil.Error:
        return "?"
    head = cmd[0] if cmd else ""
    if head.startswith("ray::"):  # Ray retitles a worker ray::Class.method (or ray::IDLE)
        return head.split()[0].split(".")[0]
    if "-m" in cmd[:-1]:
        return cmd[cmd.index("-m") + 1]
    return os.path.basename(head) or "?"
