"""Who owns an auto-made shm store, and collecting the stores of dead owners (docs/store.md#ownership-and-store-gc).

A store made for `shm://` (no folder named) is the run's scratch space: it should go with its owner. A
clean exit removes it (ShmStore.close, or the finalizer), but a SIGKILL, an OOM kill or a power cut leaves
it in /dev/shm, in RAM, until reboot. So such a store records its owner in DIR/.owner, a checksummed JSON
line: the host, the boot, the PID and the process start time, so a PID the kernel reused for another process
is not taken for the owner. The start time is the kernel's, in seconds since boot: a step of the wall clock
(NTP, a VM's clock sync) moves psutil's create_time of every process (its boot time is read off the wall
clock), which once made live owners look dead. `collect()` (`dataplane-rl store gc`, and every `train`
start) removes each auto-made store of this user whose owner is dead and that was not kept (`keep()`,
data_plane.keep_partitions).

A kept store is data the user asked for: `keep()` marks it twice, in the owner record and in DIR/.kept, a
file made once and never rewritten, so no later write or damage of the record can make it collectable; and
`collect()` decides again from the folder it renamed away before deleting anything.

State of a store folder under the root:
    live      its owner runs (same host, PID and start time)
    kept      keep() was called: it outlives its run on purpose; never collected
    orphaned  auto-made, owner dead, not kept: collected
    named     a folder the user named (shm://DIR): the user's to drop; never collected
    unknown   no readable owner record (an older dataplane-rl, or another host's): never collected
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import socket
import tempfile
import uuid
from dataclasses import dataclass
from typing import Callable, Iterator

from dataplane_rl.errors import CorruptChunkError
from dataplane_rl.pids import start_time
from dataplane_rl.store.shm.files import create_file, framed, read_file, unframe, untrusted

OWNER_FILE = ".owner"
KEPT_FILE = ".kept"
MARKER = ".dataplane-rl"
AUTO_PREFIX = "dataplane-rl-"
AUTO_NAME = re.compile(AUTO_PREFIX + r"[0-9a-f]{12}")
ROOT_ENV = "DATAPLANE_RL_SHM_ROOT"  # where auto-made stores go (default /dev/shm); tests point it elsewhere


def auto_root() -> str:
    root = os.environ.get(ROOT_ENV)
    if root:
        return os.path.abspath(root)
    return "/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir()


def new_auto_path() -> str:
    return os.path.join(auto_root(), f"{AUTO_PREFIX}{uuid.uuid4().hex[:12]}")


def _boot_id() -> str | None:
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            return f.read().strip()
    except OSError:
        return None


def this_owner() -> dict:
    return {"host": socket.gethostname(), "boot": _boot_id(), "pid": os.getpid(), "start_time": start_time(os.getpid())}


def write_owner(folder: str, auto: bool, kept: bool = False, owner: dict | None = None) -> None:
    """(Re)write the owner record; renamed into place, so a reader sees the old record or the new one."""
    record = {**(owner or this_owner()), "auto": auto, "kept": kept}
    tmp = os.path.join(folder, f".owner-{uuid.uuid4().hex}")
    create_file(tmp, framed(json.dumps(record)))
    os.rename(tmp, os.path.join(folder, OWNER_FILE))


def mark_kept(folder: str) -> None:
    """The folder outlives its owner on purpose: DIR/.kept, then the record (both say it; either suffices)."""
    with contextlib.suppress(FileExistsError):
        create_file(os.path.join(folder, KEPT_FILE))
    write_owner(folder, auto=True, kept=True)


def read_owner(folder: str) -> dict | None:
    path = os.path.join(folder, OWNER_FILE)
    try:
        record = json.loads(unframe(read_file(path), path))
        return record if isinstance(record, dict) and {"host", "pid", "start_time"} <= record.keys() else None
    except (OSError, ValueError, CorruptChunkError):
        return None


def owner_alive(owner: dict) -> bool | None:
    """Whether the recorded owner still runs: None when it is another host's (we cannot tell)."""
    if owner.get("host") != socket.gethostname():
        return None
    if "boot" in owner:
        if owner["boot"] != _boot_id():
            return False  # started before the machine's last reboot
        started = start_time(int(owner["pid"]))
    else:  # a record of an older dataplane-rl: psutil's create_time, on the wall clock
        started = _wall_clock_start(int(owner["pid"]))
    # identical in every reader: a PID reused by a later process has a later start time
    return started is not None and owner["start_time"] is not None and abs(started - owner["start_time"]) < 0.01


def _wall_clock_start(pid: int) -> float | None:
    import psutil

    try:
        p = psutil.Process(pid)
        return None if p.status() == psutil.STATUS_ZOMBIE else p.create_time()
    except psutil.Error:
        return None


def folder_bytes(folder: str) -> int:
    """Bytes the folder holds in memory (allocated blocks: chunk files are reserved whole)."""
    total = 0
    for d, _, files in os.walk(folder):
        for n in files:
            with contextlib.suppress(OSError):
                total += os.lstat(os.path.join(d, n)).st_blocks * 512
    return total


@dataclass
class StoreFolder:
    path: str
    state: str  # live | kept | orphaned | named | unknown
    owner: dict | None
    nbytes: int

    def owner_text(self) -> str:
        o = self.owner
        return f"pid {o['pid']} on {o['host']}" if o else "-"


def own_folders(root: str, wanted: Callable[[str, os.stat_result], bool],
                prefix: str = "") -> Iterator[tuple[str, str, dict | None]]:
    """(name, path, owner record) of each folder directly under `root` whose name starts with `prefix`, that
    is this user's own (any other is never listed, never touched) and `wanted(path, its lstat)`."""
    try:
        names = sorted(n for n in os.listdir(root) if n.startswith(prefix))
    except (FileNotFoundError, NotADirectoryError):
        return
    for name in names:
        path = os.path.join(root, name)
        try:
            st = os.lstat(path)
        except FileNotFoundError:
            continue
        if untrusted(path, st, folder=True) or not wanted(path, st):
            continue
        yield name, path, read_owner(path)


def scan(root: str | None = None) -> list[StoreFolder]:
    """This user's store folders directly under `root` (default: where auto-made stores go)."""
    out = []
    for name, path, owner in own_folders(root or auto_root(), lambda p, _: os.path.lexists(os.path.join(p, MARKER))):
        out.append(StoreFolder(path, _state(name, path, owner), owner, folder_bytes(path)))
    return out


def _state(name: str, path: str, owner: dict | None) -> str:
    """live | kept | orphaned | named | unknown of the store folder `path` (its name under the root: `name`)."""
    if os.path.lexists(os.path.join(path, KEPT_FILE)) or owner and owner.get("kept"):
        return "kept"
    alive = owner_alive(owner) if owner else None
    if alive:
        return "live"
    if alive is None:
        return "unknown"
    return "orphaned" if owner.get("auto") and AUTO_NAME.fullmatch(name) else "named"


def collect(root: str | None = None, say: Callable[[str], None] | None = None) -> list[StoreFolder]:
    """Remove every orphaned store under `root`; returns those removed. Each is first renamed away, so two
    collectors never both remove one, and no process opens a half-removed store by its URL."""
    removed = []
    for entry in scan(root):
        if entry.state != "orphaned":
            continue
        trash = os.path.join(os.path.dirname(entry.path), f".{AUTO_PREFIX}gc-{uuid.uuid4().hex}")
        try:
            os.rename(entry.path, trash)
        except OSError:
            continue  # another collector got it first
        # decided again from the folder as it is now: a keep() or a record written since the scan is seen here,
        # and such a folder goes back untouched
        if _state(os.path.basename(entry.path), trash, read_owner(trash)) != "orphaned":
            with contextlib.suppress(OSError):
                os.rename(trash, entry.path)
            continue
        shutil.rmtree(trash, ignore_errors=True)
        removed.append(entry)
        if say:
            say(f"removed {entry.path} ({entry.owner_text()}, dead; {entry.nbytes} bytes)")
    return removed


def collect_at_start() -> None:
    """`train`'s start: collect, and say so in one line when anything went."""
    import sys

    from dataplane_rl.units import human_bytes

    removed = collect()
    if removed:
        print(f"store gc: removed {len(removed)} orphaned store(s) of dead runs, "
              f"{human_bytes(sum(e.nbytes for e in removed))}: {', '.join(e.path for e in removed)}", file=sys.stderr)
