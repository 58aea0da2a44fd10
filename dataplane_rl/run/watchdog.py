"""`python -m dataplane_rl.run.watchdog FD`: when the run's driver dies, SIGKILL what is left of its
process group.

The CLI's driver leads a session and a process group of its own (run/supervise.py), and Ray's gcs_server,
raylet, log monitor and agents are in that group. A SIGKILL of the job's group reaches only the supervisor;
the driver dies with it (PR_SET_PDEATHSIG), and gcs_server and raylet with the driver (Ray's own
PR_SET_PDEATHSIG). Ray's dashboard and runtime-env agents, the raylet's children, do not: they were still
alive 30-60 s later (tests/test_private_run.py). Nobody is left to reap them, so this process, a member of
that group started before Ray, does it.

It holds the read end of a pipe whose write end only the driver holds: end of file means the driver has
exited, however it ended. The group cannot meanwhile become someone else's: a process group's ID is not
reused while a member, this one, lives. Only the standard library is imported: it lives as long as the run.
"""

from __future__ import annotations

import os
import signal
import sys


def watch(fd: int) -> None:
    """Block until `fd` reads end of file, then SIGKILL this process's group (this process included)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # stopping is the driver's business; SIGTERM ends this quietly
    while os.read(fd, 64):  # nothing is ever written: this returns b"" when the driver's end closes
        pass
    os.killpg(os.getpgrp(), signal.SIGKILL)


if __name__ == "__main__":
    if len(sys.argv) != 2 or not sys.argv[1].isdigit():
        print("usage: python -m dataplane_rl.run.watchdog FD", file=sys.stderr)
        sys.exit(2)
    watch(int(sys.argv[1]))
