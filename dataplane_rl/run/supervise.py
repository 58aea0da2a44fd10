"""`python -m dataplane_rl.run.supervise CMD...`: run CMD (a local run's driver) in a session of its own,
pass it the stop signals this process gets, and exit with its status (128 + N for a signal N, as a shell
reports it). `dataplane-rl train` becomes this process once it has checked its config (private_ray.reexec).

Why a session of its own: a SIGTERM to the job's whole process group (`timeout`, `kill -- -PGID`, SLURM's
scancel, a pod stop) would otherwise reach Ray's gcs_server, raylet and actors together with the driver,
and Ray's own driver-side recovery of the objects lost with them could end the driver (exit 1, no
summary.json) before its handler stopped the run. Here the group signal reaches only this process, which
sends it to the driver alone: the driver stops the run with Ray still up, then shuts Ray down itself.

The driver dies with this process (PR_SET_PDEATHSIG, SIGKILL): a kill -9 of the job still leaves nothing
running. Only the standard library is imported here: this process lives as long as the run.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import shutil
import signal
import subprocess
import sys

FORWARDED = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)
_PR_SET_PDEATHSIG = 1


def supervise(cmd: list[str]) -> int:
    """Run `cmd` in a session of its own until it exits; its exit status, as a shell reports it."""
    parent = os.getpid()

    def child() -> None:  # in the driver, between fork and exec
        if ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0) != 0:
            os._exit(70)
        if os.getppid() != parent:  # this process died before the prctl: nobody to die with
            os._exit(137)

    saved = {s: signal.getsignal(s) for s in FORWARDED}
    proc = None
    early: list[int] = []  # signals that came before the driver existed: passed on once it does

    def forward(signum, frame) -> None:
        if proc is None:
            early.append(signum)
        elif proc.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                proc.send_signal(signum)

    try:
        for s in FORWARDED:
            if saved[s] != signal.SIG_IGN:  # one ignored here (`nohup`, `&`) stays ignored: the driver inherited that
                signal.signal(s, forward)
        proc = subprocess.Popen(cmd, start_new_session=True, preexec_fn=child)
        for s in early:  # the driver ends as it would for a signal in its own first moments
            proc.send_signal(s)
        code = proc.wait()  # PEP 475: a forwarded signal does not interrupt the wait
    finally:
        for s, h in saved.items():
            signal.signal(s, h)
        drop_token_folder()
    return 128 - code if code < 0 else code


def drop_token_folder() -> None:
    """The run's Ray token folder (run/private_ray.py) was made for this process, which its owner record
    names: it goes when the driver has exited, however it ended. The driver removes it at its own exit only
    once it started Ray, so a run refused before that (a bad task.module) once left it in /tmp."""
    folder = os.environ.get(TOKEN_DIR_ENV, "")
    if os.path.basename(folder).startswith(TOKEN_PREFIX):  # never anything else, whatever the variable says
        shutil.rmtree(folder, ignore_errors=True)


# as run/private_ray.py names them; not imported from there: this process loads only the standard library
TOKEN_DIR_ENV, TOKEN_PREFIX = "DATAPLANE_RL_RAY_TOKEN_DIR", "dataplane-rl-ray-"


if __name__ == "__main__":
    if len(sys.argv) < 2:
        print("usage: python -m dataplane_rl.run.supervise CMD [ARG...]", file=sys.stderr)
        sys.exit(2)
    try:
        sys.exit(supervise(sys.argv[1:]))
    except KeyboardInterrupt:  # a Ctrl-C before the handlers were set: no driver started yet
        print("interrupted", file=sys.stderr)
        sys.exit(130)
