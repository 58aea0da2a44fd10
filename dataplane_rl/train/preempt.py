"""SIGTERM / SIGINT: finish the current step, checkpoint, stop cleanly (clusters preempt with SIGTERM).

The first signal only sets a flag that the loop reads between steps; a second SIGINT raises
KeyboardInterrupt at once, for a user who does not want to wait for the step. A SIGINT that this process
inherited as ignored (started with `&` or `nohup`) stays ignored; SIGTERM always stops the run.
"""

from __future__ import annotations

import signal
import threading


class StopSignals:
    def __init__(self) -> None:
        self.signum: int | None = None
        self._saved: dict[int, object] = {}

    @property
    def requested(self) -> bool:
        return self.signum is not None

    def _handle(self, signum, frame) -> None:
        if self.signum is not None and signum == signal.SIGINT:
            raise KeyboardInterrupt
        self.signum = signum

    def install(self) -> None:
        """(Re)install the handlers; call again after ray.init, which sets its own SIGTERM handler."""
        if threading.current_thread() is not threading.main_thread():
            return  # signals reach the main thread only; a run in a thread stops by its caller
        for sig in (signal.SIGTERM, signal.SIGINT):
            current = signal.getsignal(sig)
            if sig == signal.SIGINT and current == signal.SIG_IGN and sig not in self._saved:
                continue
            self._saved.setdefault(sig, current)
            signal.signal(sig, self._handle)

    def __enter__(self) -> "StopSignals":
        self.install()
        return self

    def __exit__(self, *exc) -> None:
        for sig, handler in self._saved.items():
            signal.signal(sig, handler)
        self._saved.clear()
