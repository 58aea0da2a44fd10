"""What a run starts listens only where it must, with the authentication Ray offers (docs/security.md).

A run that starts its own Ray (no `cluster.address`) makes it private:
- every Ray service binds 127.0.0.1. Ray has no switch for its listen address: gcs_server, raylet, the
  workers and the driver's core worker bind gRPC to the wildcard address. Two things fix it:
  RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0 makes Ray's node IP 127.0.0.1 (ray._private.services.
  get_node_ip_address, which otherwise turns 127.0.0.1 into the node's LAN address), and the bind_local.c
  preload shim (store/mooncake/bind_shim.py) turns each wildcard bind into a bind to 127.0.0.1. Every actor
  inherits it, and its Mooncake client points the shim at the address it advertises (127.0.0.1 for the
  run's own store);
- Ray's token authentication is on, with a token of this run only, in a 0600 file in a 0700 folder
  (RAY_AUTH_MODE=token, RAY_AUTH_TOKEN_PATH): Ray's own default is one token for every cluster of the
  user, in ~/.ray/auth_token.

The shim must be loaded when the process starts, so `dataplane-rl train` runs itself again once, as a child
in a session of its own, with this environment (run/supervise.py); every process Ray starts inherits
it. A program that calls `train()` itself gets the same for every process Ray starts, but its own driver
listens as Ray does (docs/security.md).

A run that joins `cluster.address` uses the cluster's settings: it warns in one line when it joins without
token authentication. The security line says what still listens on every interface.
"""

from __future__ import annotations

import atexit
import contextlib
import os
import secrets
import shutil
import stat
import sys
import tempfile
from typing import Callable

from dataplane_rl.config import Config
from dataplane_rl.hosts import is_loopback
from dataplane_rl.store.shm import owners
from dataplane_rl.store.mooncake.bind_shim import ADDRESS_ENV, bind_env

REEXEC_ENV = "DATAPLANE_RL_PRIVATE_RAY"  # set in the re-executed driver: its environment is the run's already
TOKEN_DIR_ENV = "DATAPLANE_RL_RAY_TOKEN_DIR"  # the token folder this run made, removed at its exit
NODE_IP_ENV = "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"
AUTH_MODE_ENV, TOKEN_PATH_ENV = "RAY_AUTH_MODE", "RAY_AUTH_TOKEN_PATH"
TASK_EVENTS_ENV = "RAY_task_events_max_num_task_in_gcs"
NICENESS_ENV = "RAY_worker_niceness"
SPIN_ENV = "GOMP_SPINCOUNT"
# torch's OpenMP threads (libgomp) spin 300,000 times at every barrier before they sleep, while another process
# wants the core: on a shared 2-core machine the default run beside 2 busy loops took 545 s with that and 126 s
# with 10,000 spins (docs/models.md, "A shared machine"); idle, 10,000 costs a few percent.
SPIN_COUNT = "10000"
SECURITY_DOC = "docs/security.md"


def one_machine(cfg: Config) -> bool:
    """No cluster to join, and a store URL naming no host but this one's loopback."""
    if cfg.cluster.address:
        return False
    url = cfg.data_plane.url or ""
    scheme, _, rest = url.partition("://")
    host = rest.partition("?")[0].rpartition(":")[0].strip("[]") if scheme in ("mooncake", "ray") else ""
    return not host or is_loopback(host)


TOKEN_PREFIX = "dataplane-rl-ray-"


def _new_token() -> dict[str, str]:
    folder = tempfile.mkdtemp(prefix=TOKEN_PREFIX)  # 0700
    # its owner: this process, which runs (or, from the CLI, becomes the supervisor of) the run; a run
    # killed with SIGKILL leaves the folder, and the next run's start removes it once its owner is dead
    owners.write_owner(folder, auto=True)
    path = os.path.join(folder, "auth_token")
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(secrets.token_hex(32))
    return {AUTH_MODE_ENV: "token", TOKEN_PATH_ENV: path, TOKEN_DIR_ENV: folder}


def private_env(env: dict[str, str]) -> dict[str, str]:
    """`env` plus what makes a local Ray private (a user's own RAY_AUTH_MODE is respected)."""
    out = dict(env)
    out.setdefault(NODE_IP_ENV, "0")
    # Ray's GCS keeps the events of the last 100,000 tasks for its state API (`ray list tasks`): a run
    # submits a few tasks a step, and its GCS grew ~2.4 MB per 100 steps through a 1000-step soak
    # (benchmarks/soak.py). The last 1,000 are kept.
    out.setdefault(TASK_EVENTS_ENV, "1000")
    # Ray starts its workers at nice 15 (its worker_niceness), so beside any other work on the machine the train
    # and rollout workers got what was left of the cores (a default run took 19 min instead of ~75 s): they run at
    # the caller's own level, and `nice -n N dataplane-rl train` lowers the whole run.
    out.setdefault(NICENESS_ENV, str(os.nice(0)))
    out.setdefault(SPIN_ENV, SPIN_COUNT)
    if AUTH_MODE_ENV not in out:
        out.update(_new_token())
    if ADDRESS_ENV not in out:
        out = bind_env("127.0.0.1", out)  # unchanged when no C compiler can build the shim
    return out


def reexec(cfg: Config, argv: list[str]) -> None:
    """For the CLI: run again, once, as `python -m dataplane_rl.cli.main ARGV` with the private
    environment, so the driver's own listeners bind 127.0.0.1 too. This process becomes the driver's
    supervisor (run/supervise.py: the driver in a session of its own, stop signals passed on), a small
    process of its own rather than this one, which has torch loaded. Returns only when nothing is to do."""
    if REEXEC_ENV in os.environ or cfg.cluster.address:
        return
    env = private_env({**os.environ, REEXEC_ENV: "1"})
    sys.stdout.flush()
    sys.stderr.flush()
    os.execve(sys.executable, [sys.executable, "-m", "dataplane_rl.run.supervise", sys.executable, "-m",
                               "dataplane_rl.cli.main", *argv], env)


def collect_tokens(root: str | None = None) -> list[str]:
    """Remove the token folders of this user's runs whose owner is dead (a SIGKILLed run's); returns them.
    A folder that is not this user's private one, or whose owner is alive or on another host, stays."""

    def private(path: str, st: os.stat_result) -> bool:  # 0700, as made: nobody else's token
        return not stat.S_IMODE(st.st_mode) & 0o077

    removed = []
    for _, folder, owner in owners.own_folders(root or tempfile.gettempdir(), private, prefix=TOKEN_PREFIX):
        if owner is not None and owners.owner_alive(owner) is False:
            shutil.rmtree(folder, ignore_errors=True)
            removed.append(folder)
    return removed


def make_private() -> Callable[[], None]:
    """Before this process starts a local Ray: the private environment for every process Ray starts.
    Returns what undoes it once that Ray is shut down, so that nothing this process starts later (another
    Ray, a subprocess on another address) inherits the shim or the 127.0.0.1 node IP."""
    added = {k: v for k, v in private_env(dict(os.environ)).items() if k not in os.environ}
    os.environ.update(added)
    folder = os.environ.get(TOKEN_DIR_ENV)
    if folder and TOKEN_DIR_ENV not in added:  # the CLI's re-executed driver: the token goes when it exits
        atexit.register(shutil.rmtree, folder, True)
    _refresh_ray()

    def undo() -> None:
        for key in added:
            os.environ.pop(key, None)
        if TOKEN_DIR_ENV in added:
            shutil.rmtree(added[TOKEN_DIR_ENV], ignore_errors=True)
        _refresh_ray()

    return undo


def _refresh_ray() -> None:
    """Make this process's Ray see the environment as it is now."""
    import ray._private.ray_constants as ray_constants
    from ray._raylet import AuthenticationTokenLoader, Config as RayConfig

    ray_constants.ENABLE_RAY_CLUSTER = os.environ.get(NODE_IP_ENV) != "0"  # Ray read the variable at its import
    RayConfig.initialize("")  # Ray caches RAY_AUTH_MODE; re-read it (as Ray's own _enable_token_auth does)
    AuthenticationTokenLoader.instance().reset_cache()


def check_dashboard(cfg: Config) -> None:
    """cluster.include_dashboard=true for a local Ray needs Ray's dashboard packages: one ConfigError before
    Ray starts (ray.init would raise "Cannot include dashboard with missing packages" after a log screen)."""
    if not cfg.cluster.include_dashboard or cfg.cluster.address:
        return
    from ray._private.utils import get_dashboard_dependency_error

    from dataplane_rl.errors import ConfigError

    missing = get_dashboard_dependency_error()
    if missing is not None:
        raise ConfigError(f"cluster.include_dashboard=true needs Ray's dashboard packages ({missing}): "
                          "pip install 'ray[default]', or set cluster.include_dashboard=false")


def stop_unused(cfg: Config) -> list[str]:
    """Once this process's ray.init has started a local Ray: stop the dashboard head and the autoscaler
    monitor, unless cluster.include_dashboard. Ray starts both whatever include_dashboard says (False only
    trims the dashboard's modules) and nothing of a run talks to them (about 105 + 80 MB resident). Ray's
    own Node.kill_* is used, so its shutdown knows they were stopped on purpose. The dashboard and runtime-env
    agents stay: the raylet refuses to start without their commands and exits when either agent does.
    Returns the names of the processes stopped."""
    if cfg.cluster.include_dashboard or cfg.cluster.address:
        return []
    import psutil
    import ray._private.ray_constants as ray_constants
    from ray._private import worker

    node = worker._global_node
    stopped = []
    for kind, kill in ((ray_constants.PROCESS_TYPE_DASHBOARD, node.kill_dashboard),
                       (ray_constants.PROCESS_TYPE_MONITOR, node.kill_monitor)):
        infos = node.all_processes.get(kind, [])
        # the dashboard may start modules of its own; Ray kills only the process it started
        kids = []
        for info in infos:
            with contextlib.suppress(psutil.Error):
                kids += psutil.Process(info.process.pid).children(recursive=True)
        if infos:
            kill(check_alive=False)  # one that died on its own is fine: nothing needs it
            stopped.append(kind)
        for p in kids:
            with contextlib.suppress(psutil.Error):
                p.kill()
        psutil.wait_procs(kids, timeout=5)
    return stopped


def auth_on() -> bool:
    return os.environ.get(AUTH_MODE_ENV, "").lower() == "token"


def open_warning(cfg: Config) -> str | None:
    """One warning line when this run's Ray has no token authentication."""
    if auth_on():
        return None
    where = f"the Ray cluster at {cfg.cluster.address}" if cfg.cluster.address else "this run's local Ray"
    return (f"warning: {where} runs without token authentication ({AUTH_MODE_ENV}="
            f"{os.environ.get(AUTH_MODE_ENV, 'unset')}): anyone who reaches its ports can run code as its user; "
            f"start it with {AUTH_MODE_ENV}=token ({SECURITY_DOC})")


def security_line(cfg: Config) -> str:
    """What listens on every interface, in one line (the table is in docs/security.md)."""
    if cfg.cluster.address:
        return ("security: on a cluster, Ray (GCS port of cluster.address, raylet, object manager, workers) and "
                "the Mooncake clients and holders listen on every interface of each node: firewall them to the "
                f"cluster's network ({SECURITY_DOC})")
    if ADDRESS_ENV not in os.environ:
        return ("security: no C compiler built the bind shim, so Ray and the Mooncake clients of this run listen "
                f"on every interface (random ports): install cc, or firewall them ({SECURITY_DOC})")
    driver = "" if REEXEC_ENV in os.environ else (", except this program's own Ray driver, which listens on every "
                                                   "interface (run `dataplane-rl train` to avoid it)")
    store = "the data plane" if one_machine(cfg) else "the data plane's clients on this node's address"
    return (f"security: Ray{' (token auth, per-run token)' if auth_on() else ''} on 127.0.0.1 and {store} "
            f"listen on no other interface{driver} ({SECURITY_DOC})")
