"""Store ownership (docs/store.md#ownership-and-store-gc): an auto-made shm store records its owner (host, PID, start time);
`store gc` removes those of dead owners that were not kept, and never a live or kept one, even when the
owner's PID now belongs to another process. Every store here lives under a private temporary root
(DATAPLANE_RL_SHM_ROOT), so no other run's store on this machine is ever looked at."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest

from dataplane_rl.store import open_store
from dataplane_rl.store.shm import owners
from store_workers import grpo_columns

# a stand-in for a run's driver: makes its store, writes a partition, says where, waits to be killed
OWNER = ("import time, numpy as np; from dataplane_rl.store import open_store; s = open_store('shm://'); "
         "s.create_partition('p', 'grpo', 4); s.put('p', {'total_reward': np.ones(4, np.float32)}, range(4)); "
         "print(s.url, flush=True); time.sleep(600)")


@pytest.fixture
def root(tmp_path, monkeypatch):
    path = tmp_path / "shm"
    path.mkdir(mode=0o700)
    monkeypatch.setenv(owners.ROOT_ENV, str(path))
    return path


def cli(*args: str) -> str:
    p = subprocess.run([sys.executable, "-m", "dataplane_rl.cli.main", "store", *args], capture_output=True,
                       text=True, timeout=120)
    assert p.returncode == 0, p.stderr
    return p.stdout


def forged(root, name: str, **record) -> str:
    """A store whose owner record says what the test needs (the PID-reuse cases cannot be caused)."""
    s = open_store(f"shm://{root}/{name}")
    s.close()
    owners.write_owner(str(root / name), **record)
    return str(root / name)


def test_gc_reaps_a_sigkilled_owner_and_leaves_live_kept_and_named_stores(root):
    killed = subprocess.Popen([sys.executable, "-c", OWNER], stdout=subprocess.PIPE, text=True)
    try:
        line = killed.stdout.readline()  # bounded: the child prints within its start-up or dies (EOF)
        assert line.startswith("shm://"), f"the owner died before making its store (code {killed.poll()})"
        orphan = line.strip()[len("shm://"):]
        os.kill(killed.pid, signal.SIGKILL)
        killed.wait(timeout=60)
    finally:
        if killed.poll() is None:
            killed.kill()
    live = open_store("shm://")  # owned by this test process, alive
    live.create_partition("p", "grpo", 1)
    kept = open_store("shm://")
    kept.keep()
    kept_path = str(kept.path)
    kept.close()
    me = owners.this_owner()
    reused = dict(me, start_time=me["start_time"] - 1000)  # this PID, but a process started before: not us
    dead_reused = forged(root, "dataplane-rl-0123456789ab", auto=True, owner=reused)
    kept_reused = forged(root, "dataplane-rl-ba9876543210", auto=True, kept=True, owner=reused)
    named_dead = forged(root, "mine", auto=False, owner=reused)
    states = {e["path"]: e["state"] for e in json.loads(cli("ls", "--json"))}
    assert states == {orphan: "orphaned", dead_reused: "orphaned", str(live.path): "live", kept_path: "kept",
                      kept_reused: "kept", named_dead: "named"}

    out = cli("gc")
    assert f"removed {orphan} (pid {killed.pid} on " in out and "removed 2 orphaned store(s), " in out, out
    assert not os.path.exists(orphan) and not os.path.exists(dead_reused)
    for path in (live.path, kept_path, kept_reused, named_dead):
        assert os.path.exists(os.path.join(path, owners.MARKER)), f"{path} was touched"
    live.put("p", grpo_columns([0], ["total_reward"]), [0])  # the live store still works
    live.close()
    assert cli("gc").strip() == "removed 0 orphaned store(s), 0 bytes (0 B)"


def test_a_store_of_another_user_is_never_listed_or_removed(root):
    if os.geteuid() != 0:
        pytest.skip("chown needs root")
    path = forged(root, "dataplane-rl-00000000beef", auto=True, owner={"host": "x", "pid": 1, "start_time": 0.0})
    for d, ds, fs in os.walk(path):
        for n in [d, *(os.path.join(d, x) for x in ds + fs)]:
            os.chown(n, 65534, 65534)
    assert owners.scan() == [] and owners.collect() == []
    assert os.path.exists(path)


def test_owner_record_follows_keep_and_a_clean_close_removes_the_store(root):
    s = open_store("shm://")
    rec = owners.read_owner(str(s.path))
    assert rec["pid"] == os.getpid() and rec["auto"] and not rec["kept"]
    assert abs(rec["start_time"] - owners.this_owner()["start_time"]) < 0.01 and rec["start_time"] < time.time()
    s.close()
    assert not s.path.exists() and owners.scan() == []


def test_an_owner_stays_alive_through_a_step_of_the_wall_clock(root, monkeypatch):
    """A wall-clock step (NTP, a VM's clock sync; CI met one of 18.7 s) moves psutil's create_time of every
    process (boot time read off the wall clock + ticks): an owner recorded before it looked dead, and a
    concurrent run's gc took a live run's Ray token. The start time is the kernel's, since boot: no step moves
    it. The step is simulated in psutil (a test does not set the machine's clock)."""
    import psutil

    me = owners.this_owner()
    real = psutil.Process.create_time
    monkeypatch.setattr(psutil.Process, "create_time", lambda self: real(self) + 18.7)
    assert owners.owner_alive(me) is True
    s = open_store("shm://")  # a live store of this process: gc leaves it
    try:
        assert owners.collect() == [] and s.path.exists()
    finally:
        s.close()
    assert owners.owner_alive(dict(me, boot="another-boot")) is False  # this PID before a reboot: not us
    assert owners.owner_alive(dict(me, start_time=me["start_time"] - 1)) is False  # a reused PID
    legacy = {k: v for k, v in me.items() if k != "boot"} | {"start_time": real(psutil.Process())}
    assert owners.owner_alive(legacy) is False  # an older record is read on the wall clock, which stepped
    monkeypatch.undo()
    assert owners.owner_alive(legacy) is True


def test_a_dead_runs_ray_token_folder_is_reaped_and_no_other(tmp_path, monkeypatch):
    """A SIGKILLed run leaves its Ray token folder (its exit handler never ran); the next run's start
    removes it once its owner is dead, and never a live run's folder or one that is not this user's private
    folder."""
    from dataplane_rl.run import private_ray

    monkeypatch.setenv("TMPDIR", str(tmp_path))
    import tempfile

    monkeypatch.setattr(tempfile, "tempdir", None)  # gettempdir() reads TMPDIR again
    made = ("import json; from dataplane_rl.run import private_ray; "
            "print(json.dumps(private_ray._new_token()))")
    p = subprocess.run([sys.executable, "-c", made], capture_output=True, text=True, timeout=120,
                       env=dict(os.environ, TMPDIR=str(tmp_path)))
    assert p.returncode == 0, p.stderr
    dead = json.loads(p.stdout)[private_ray.TOKEN_DIR_ENV]  # its maker exited without removing it
    live = private_ray._new_token()[private_ray.TOKEN_DIR_ENV]  # this process: alive
    shared = tmp_path / f"{private_ray.TOKEN_PREFIX}shared"
    shared.mkdir(mode=0o755)
    os.chmod(shared, 0o755)
    owners.write_owner(str(shared), auto=True, owner={**owners.read_owner(dead)})  # a dead owner, not private
    for folder in (dead, live):
        assert os.path.isfile(os.path.join(folder, "auth_token")) and os.stat(folder).st_mode & 0o777 == 0o700
    assert private_ray.collect_tokens() == [dead]
    assert not os.path.exists(dead) and os.path.isdir(live) and shared.is_dir()
    assert private_ray.collect_tokens() == []


def test_a_kept_store_survives_gc_whatever_its_owner_record_says(root):
    """A kept store is data. keep() marks it in DIR/.kept as well as in the owner record, so a record
    rewritten afterwards as an unkept auto store of a dead owner (or damaged) cannot make gc remove it."""
    kept = open_store("shm://")
    kept.create_partition("p", "grpo", 1)
    kept.put("p", grpo_columns([0], ["total_reward"]), [0])
    kept.keep()
    path, url = str(kept.path), kept.url
    kept.close()
    me = owners.this_owner()
    owners.write_owner(path, auto=True, owner=dict(me, start_time=me["start_time"] - 1000))  # a dead owner's
    assert [(e.path, e.state) for e in owners.scan()] == [(path, "kept")]
    assert cli("gc").strip() == "removed 0 orphaned store(s), 0 bytes (0 B)"
    with open(os.path.join(path, owners.OWNER_FILE), "wb") as f:
        f.write(b"damaged")
    assert owners.collect() == [] and owners.scan()[0].state == "kept"
    again = open_store(url, create=False)
    assert again.get("p", ["total_reward"]).num_rows == 1  # nothing of it went
    again.close()
