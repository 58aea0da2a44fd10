"""A process's identity beyond its PID: when it started, from Linux's /proc (a PID reused by a newer process
has a later start). Used by the store's owner records and the run's reaper."""

from __future__ import annotations

import os

_CLOCK_TICKS = os.sysconf("SC_CLK_TCK")


def start_time(pid: int) -> float | None:
    """When process `pid` started, in seconds since boot (the kernel's starttime: no wall clock in it), or None
    if it is gone (a zombie is gone: only its exit status is left)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
    except OSError:
        return None
    fields = stat[stat.rindex(b")") + 2:].split()  # the command may hold spaces and ')': fields after the last
    return None if fields[0] == b"Z" else int(fields[19]) / _CLOCK_TICKS  # state is field 3, starttime 22
