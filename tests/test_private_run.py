"""A local run is private, and a killed run's store does not outlive it (docs/security.md; docs/store.md#ownership-and-store-gc).

One real `dataplane-rl train` (data plane on shm, a checkpoint per step) is watched: every listening socket
of every process it started binds loopback (docs/security.md names no exception for a local run), and its
Ray token is a private file of its own. It is then SIGKILLed with its whole process group after step 1's
checkpoint: its store stays behind, orphaned, and `train --resume` of that run reaps it, saying so in
one line. Before it, on the same root, a one-step run kept its store (data_plane.keep_partitions=true): that
store outlives the killed run, the resume's collection and `store gc`. Stores go to a private
temporary root (DATAPLANE_RL_SHM_ROOT): no other store is looked at."""

from __future__ import annotations

import json
import os
import shutil
import signal
import stat
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from dataplane_rl.config import load_config
from dataplane_rl.errors import ConfigError
from dataplane_rl.store.shm import owners
from dataplane_rl.run import private_ray
from test_shutdown import CHILD, Tree, wait_for
from test_train_e2e import overriding

TINY = ["grpo.num_prompts_per_step=2", "grpo.num_generations_per_prompt=2", "grpo.max_num_steps=2",
        "policy.train_global_batch_size=4", "policy.train_micro_batch_size=2", "generation.max_new_tokens=4",
        "logger.progress=false", "data_plane.enabled=true", "checkpointing.enabled=true",
        "checkpointing.save_period=1"]
LOOPBACK = {"127.0.0.1", "::ffff:127.0.0.1", "::1"}


def listeners(tree: Tree) -> list[tuple[str, str]]:
    """(address, 'port pid command') of every listening TCP socket of the run's processes."""
    pids = {tree.root.pid} | {p.pid for p in tree.poll()}
    return [(c.laddr.ip, f"{c.laddr.port} pid {c.pid} {tree.seen.get(c.pid, ('', 'driver'))[1][:60]}")
            for c in psutil.net_connections("inet") if c.status == psutil.CONN_LISTEN and c.pid in pids]


@pytest.fixture(scope="module")
def kept_run(tmp_path_factory):
    """(env, run folder, its kept store) of a one-step run with data_plane.keep_partitions=true, ended normally."""
    tmp = tmp_path_factory.mktemp("private")
    root, run_dir = tmp / "shm", tmp / "kept"
    root.mkdir(mode=0o700)
    env = dict(os.environ, PYTHONUNBUFFERED="1", **{owners.ROOT_ENV: str(root)})
    for key in ("RAY_AUTH_MODE", private_ray.REEXEC_ENV, private_ray.NODE_IP_ENV, "RAY_ADDRESS"):
        env.pop(key, None)  # the run must make its own choices
    p = subprocess.run([sys.executable, "-c", CHILD, "train", *overriding(TINY, "grpo.max_num_steps=1", "checkpointing.enabled=false"),
                        "data_plane.keep_partitions=true", f"logger.run_dir={run_dir}"], capture_output=True, text=True,
                       env=env, timeout=600)
    assert p.returncode == 0, p.stderr[-3000:]
    (kept,) = owners.scan(str(root))
    assert kept.state == "kept" and json.loads((run_dir / "summary.json").read_text())["kept_store_url"].endswith(kept.path)
    return env, run_dir, kept.path


@pytest.fixture(scope="module")
def killed_run(tmp_path_factory, kept_run):
    """(run folder, env, listeners seen, token file mode, the orphaned folders: its store and its shared weights)
    of a run SIGKILLed after step 1, on the root where `kept_run` kept its store."""
    env, kept_dir, kept = kept_run
    run_dir, root = kept_dir.parent / "run", env[owners.ROOT_ENV]
    proc = subprocess.Popen([sys.executable, "-c", CHILD, "train", *TINY, f"logger.run_dir={run_dir}"],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env,
                            start_new_session=True)
    tree, token = Tree(psutil.Process(proc.pid)), None
    try:
        wait_for("step 1's checkpoint", lambda: (run_dir / "checkpoints" / "step_000001").is_dir(), proc, tree, 420)
        seen = listeners(tree)
        live = [" ".join(q.cmdline()) for q in _alive(tree.poll())]
        # the command supervises; its child, in a session of its own, is the driver with the run's environment
        driver = psutil.Process(proc.pid).children()[0]
        token = driver.environ().get("RAY_AUTH_TOKEN_PATH")
        modes = (stat.S_IMODE(os.stat(token).st_mode), stat.S_IMODE(os.stat(os.path.dirname(token)).st_mode)) \
            if token else None
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=60)
        # the driver, in a session of its own, gets its SIGKILL from the kernel as the command dies
        # (PR_SET_PDEATHSIG): wait, bounded, until it is gone before its store is looked at
        deadline = time.monotonic() + 30
        while _running(driver) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not _running(driver), "the driver outlived its supervisor's SIGKILL by 30 s"
        # Ray's processes, in the driver's session and not the job's group, die with it (Ray's kernel
        # fate-sharing: PR_SET_PDEATHSIG on gcs_server, raylet and the rest; the workers with the raylet)
        while tree.alive() and time.monotonic() < deadline + 30:
            time.sleep(0.1)
        outlived = tree.alive()
    finally:
        if proc.poll() is None:
            proc.kill()
        tree.kill_all()  # Ray's own processes may sit in sessions of their own
        if token:
            shutil.rmtree(os.path.dirname(token), ignore_errors=True)  # the next train would reap it; none runs here
    out = proc.stdout.read()
    assert proc.returncode == -signal.SIGKILL, out[-3000:]
    ever = [cmd for _, cmd in tree.seen.values()]
    return run_dir, env, seen, modes, out, [e for e in owners.scan(root) if e.path != kept], (ever, live, outlived)


def _alive(procs: list[psutil.Process]) -> list[psutil.Process]:
    return [p for p in procs if _running(p)]


def _running(p: psutil.Process) -> bool:
    try:
        return p.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def test_a_local_run_listens_on_loopback_only_with_a_private_token(killed_run):
    _, _, seen, modes, out, _, _ = killed_run
    assert seen, "no listening socket was seen: the check looked at the wrong processes"
    wide = [f"{ip} {what}" for ip, what in seen if ip not in LOOPBACK]
    assert not wide, "listening beyond loopback:\n" + "\n".join(wide)
    assert modes == (0o600, 0o700), modes
    assert "security: Ray (token auth, per-run token) on 127.0.0.1" in out, out[-2000:]
    assert "warning:" not in out, out[-2000:]


def test_resume_of_a_sigkilled_run_reaps_its_store(killed_run):
    run_dir, env, _, _, _, stores, _ = killed_run
    # the run's store, and its train rank's folder of shared weights (model/shared_weights.py), both owned
    assert [e.state for e in stores] == ["orphaned", "orphaned"], stores
    kinds = sorted((Path(e.path) / owners.MARKER).read_bytes() == b"shared weights\n" for e in stores)
    assert kinds == [False, True], stores
    assert all(os.path.exists(e.path) for e in stores)
    p = subprocess.run([sys.executable, "-c", CHILD, "train", "--resume", str(run_dir)], capture_output=True,
                       text=True, env=env, timeout=600)
    assert p.returncode == 0, p.stderr[-3000:]
    line = next((x for x in p.stderr.splitlines() if x.startswith("store gc:")), "")
    assert line.startswith("store gc: removed 2 orphaned store(s) of dead runs, "), p.stderr
    assert all(e.path in line and not os.path.exists(e.path) for e in stores), line
    assert json.loads((run_dir / "summary.json").read_text())["status"] == "completed"
    # the resumed run's own store went with it; the kept one stays (test below)
    assert [e.state for e in owners.scan(env[owners.ROOT_ENV])] == ["kept"]


def test_a_kept_store_outlives_a_killed_run_and_every_collection(killed_run, kept_run):
    """A kept run, then a run SIGKILLed with its process group, then `store gc` (and, when the resume
    test ran first, that run's --resume, whose start collected the killed run's store): the kept store and
    every partition in it stay; only the killed run's store goes."""
    _, _, _, _, _, orphans, _ = killed_run
    env, kept_dir, kept = kept_run
    p = subprocess.run([sys.executable, "-m", "dataplane_rl.cli.main", "store", "gc"], capture_output=True,
                       text=True, env=env, timeout=120)
    assert p.returncode == 0 and kept not in p.stdout, p.stdout + p.stderr
    assert [(e.path, e.state) for e in owners.scan(env[owners.ROOT_ENV])] == [(kept, "kept")]
    assert not any(os.path.exists(e.path) for e in orphans)
    p = subprocess.run([sys.executable, "-m", "dataplane_rl.cli.main", "store", "ls", str(kept_dir)],
                       capture_output=True, text=True, env=env, timeout=120)
    assert p.returncode == 0 and "1 partition(s)" in p.stdout and "step-000001  schema grpo  4 rows" in p.stdout, \
        p.stdout + p.stderr


DASHBOARD, MONITOR = "ray/dashboard/dashboard.py", "ray/autoscaler/_private/monitor.py"


def test_a_local_run_stops_rays_dashboard_and_monitor(killed_run):
    """cluster.include_dashboard=false (the default): Ray starts its dashboard head and autoscaler monitor
    anyway; by the first checkpoint neither runs, and nothing listens on the dashboard's port."""
    _, _, seen, _, _, _, (ever, live, _) = killed_run
    for name in (DASHBOARD, MONITOR):
        assert any(name in cmd for cmd in ever), f"Ray never started {name}: this check looks at nothing"
        assert not any(name in cmd for cmd in live), f"{name} still runs:\n" + "\n".join(live)
    assert not [what for _, what in seen if what.startswith("8265 ")], seen  # the dashboard's port


def test_a_group_sigkill_leaves_no_process(killed_run):
    """SIGKILL of the job's whole group reaches only the supervisor: the driver dies with it
    (PR_SET_PDEATHSIG) and every Ray process with the driver; none may be left for the test to kill."""
    _, _, _, _, _, _, (ever, _, outlived) = killed_run
    assert any("raylet" in cmd for cmd in ever), f"no Ray process was tracked: {ever}"
    assert not outlived, "processes outlived a SIGKILL of the run's group:\n" + "\n".join(outlived)


def test_include_dashboard_needs_rays_dashboard_packages():
    from ray._private.utils import get_dashboard_dependency_error

    missing = get_dashboard_dependency_error()
    if missing is None:
        pytest.skip("ray[default] is installed here: the dashboard can start")
    with pytest.raises(ConfigError, match=r"^cluster.include_dashboard=true needs Ray's dashboard packages .*"
                                          r"pip install 'ray\[default\]'"):
        private_ray.check_dashboard(load_config(None, ["cluster.include_dashboard=true"]))
    private_ray.check_dashboard(load_config(None, ["cluster.include_dashboard=true", "cluster.address=10.0.0.1:6379"]))


def test_warning_when_ray_runs_without_token_auth(monkeypatch):
    cfg = load_config(None, ["cluster.address=10.0.0.1:6379"])
    monkeypatch.delenv("RAY_AUTH_MODE", raising=False)
    line = private_ray.open_warning(cfg)
    assert line.startswith("warning: the Ray cluster at 10.0.0.1:6379 runs without token authentication")
    assert "\n" not in line and "docs/security.md" in line
    assert "every interface of each node" in private_ray.security_line(cfg)
    monkeypatch.setenv("RAY_AUTH_MODE", "token")
    assert private_ray.open_warning(cfg) is None
    monkeypatch.setenv("RAY_AUTH_MODE", "disabled")
    assert private_ray.open_warning(load_config(None, [])).startswith("warning: this run's local Ray runs without")


def test_in_process_privacy_is_undone_after_the_run():
    """A program that calls train() itself: the private environment lives only as long as its Ray. In a
    process of its own: make_private resets this process's Ray token cache, which would cut the test
    session's own Ray client off its (differently authenticated) GCS."""
    keys = ("RAY_AUTH_MODE", "RAY_AUTH_TOKEN_PATH", private_ray.TOKEN_DIR_ENV, private_ray.NODE_IP_ENV,
            "DATAPLANE_RL_BIND_ADDRESS", "LD_PRELOAD")
    child = f"""
import os, stat
from dataplane_rl.run import private_ray
keys = {keys!r}
undo = private_ray.make_private()
token = os.environ["RAY_AUTH_TOKEN_PATH"]
assert os.environ["RAY_AUTH_MODE"] == "token" and stat.S_IMODE(os.stat(token).st_mode) == 0o600
assert len(open(token).read()) == 64
undo()
assert not set(keys) & set(os.environ), set(keys) & set(os.environ)
assert not os.path.exists(os.path.dirname(token))
"""
    env = {k: v for k, v in os.environ.items() if k not in keys}
    p = subprocess.run([sys.executable, "-c", child], env=env, capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr[-3000:]
