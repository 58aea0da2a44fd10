"""The processes of a local Mooncake cluster: started to die with their parent, stopped politely, their logs read back."""

from __future__ import annotations

import ctypes
import os
import signal
import subprocess
import threading
from dataclasses import dataclass


def log_tail(path: str | None, lines: int = 12) -> str:
    """The last `lines` lines of a log, preceded by its last error lines (glog E/F) if those scrolled off."""
    if not path or not os.path.exists(path):
        return "(no log)"
    try:
        with open(path, "rb") as f:
            f.seek(0, os.SEEK_END)
            f.seek(max(0, f.tell() - 65536))
            text = f.read().decode("utf-8", "replace")
    except OSError as e:
        return f"(log unreadable: {e})"
    all_lines = [ln for ln in text.splitlines() if ln.strip()]
    out = all_lines[-lines:]
    errors = [ln for ln in all_lines[:-lines] if ln[:1] in "EF" and ln[1:2].isdigit()][-5:]
    if errors:
        out = errors + ["..."] + out
    return "\n".join("    " + ln for ln in out) if out else "(empty log)"


def die_with_parent() -> None:  # runs in the child between fork and exec
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except Exception:
        pass


@dataclass
class HolderInfo:
    index: int
    pid: int
    segment_name: str  # what the master calls the segment; usable as ReplicateConfig.preferred_segment
    segment_size: int
    log_path: str


def stop_process(proc: subprocess.Popen, timeout: float, sig: int = signal.SIGTERM) -> None:
    if proc.poll() is not None:
        return
    try:
        proc.send_signal(sig)
    except ProcessLookupError:
        return
    try:
        proc.wait(timeout)
    except subprocess.TimeoutExpired:
        try:
            proc.kill()
        except ProcessLookupError:
            pass
        proc.wait(5)


def stop_all(procs: list[subprocess.Popen], timeout: float, sig: int = signal.SIGTERM) -> None:
    """stop_process on each at once: holders unmount on SIGTERM in about 1 s each."""
    threads = [threading.Thread(target=stop_process, args=(p, timeout, sig), daemon=True) for p in procs]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout + 10)
