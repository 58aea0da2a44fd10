"""Two hosts on one machine: Ray and Mooncake across two Linux network namespaces, with the recipe of docs/cluster.md.

Namespace A (the head, 10.231.0.1) and namespace B (a worker, 10.231.0.2) are joined by a veth pair on a
test-only subnet that exists only inside them. Each has its own loopback, so any address that wrongly
says 127.0.0.1 breaks the run. The cluster commands of docs/cluster.md (RECIPE below; a test checks the page
holds them verbatim) start a token-authenticated Ray head in A and a worker in B, a Mooncake master in A
and a holder in each. Needs root and `ip` (CI has both): without them the tests fail under
DATAPLANE_RL_REQUIRE_BACKENDS=1 and skip elsewhere. Only processes inside the namespaces are killed, by
PID, and the namespaces are deleted however the tests end. Ray gets a private RAY_TMPDIR, so its
ray_current_cluster file never lands in /tmp/ray where other runs would find it.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

from conftest import backend_unavailable
from test_shared_machine import GLOG_LINE
from test_train_e2e import assert_close, assert_store_failure_left_a_consistent_run

REPO = Path(__file__).resolve().parents[1]
HEAD, WORKER = "10.231.0.1", "10.231.0.2"
SEGMENT = 256 << 20
TINY = ("grpo.num_prompts_per_step=8 grpo.num_generations_per_prompt=4 policy.train_global_batch_size=16 "
        "policy.train_micro_batch_size=4 generation.max_new_tokens=6")

# docs/cluster.md's recipe, command for command ($HEAD, $SEGMENT and the token come from the environment).
RECIPE = {
    "token": "export RAY_AUTH_MODE=token RAY_AUTH_TOKEN=$(ray get-auth-token --generate)",
    "ray_head": "ray start --head --node-ip-address=$HEAD --port=6379 --block > ray.log 2>&1 & echo $! > ray.pid",
    "master": ("mooncake_master --rpc_address=$HEAD --rpc_port=50051 --metrics_host=$HEAD --metrics_port=50052 "
               "--enable_http_metadata_server=false --eviction_high_watermark_ratio=1.0 --eviction_ratio=0.0 "
               "> master.log 2>&1 & echo $! > master.pid"),
    "holder": ("python -m dataplane_rl.store.mooncake.holder --master $HEAD:50051 --segment-size $SEGMENT "
               "> holder.log 2>&1 & echo $! > holder.pid"),
    "ray_worker": "ray start --address=$HEAD:6379 --block > ray.log 2>&1 & echo $! > ray.pid",
    "train": ("dataplane-rl train --config configs/grpo_mooncake.yaml cluster.address=auto "
              "data_plane.backend=mooncake://$HEAD:50051 generation.num_workers=2 policy.dp_size=2 "
              f"loss_fn.positive_example_nll_weight=0.1 grpo.max_num_steps=2 {TINY}"),
    "placement": "python -c \"import json; print(json.load(open('runs/latest/summary.json'))['nodes'])\"",
    "stop": "kill $(cat holder.pid) $(cat ray.pid)",
    "stop_master": "kill $(cat master.pid)",
}


def _flat(text: str) -> str:
    return re.sub(r"\s+", " ", text.replace("\\\n", " ")).strip()


def test_readme_cluster_recipe_is_the_tested_one():
    section = (REPO / "docs" / "cluster.md").read_text()
    flat = _flat(section)
    for name, cmd in RECIPE.items():
        assert _flat(cmd) in flat, f"docs/cluster.md lacks the tested '{name}' command: {cmd}"
    blocks = re.findall(r"(.*)\n```bash\n", section)
    assert blocks and all("readme-test: skip" in line for line in blocks), "mark every cluster block as skipped"


def _wait(what: str, ok, procs=(), timeout: float = 90.0, logs=()) -> None:
    """Poll `ok()` up to `timeout` s; fail early, with the logs, when a process it depends on died."""
    deadline = time.monotonic() + timeout
    while not ok():
        dead = [p for p in procs if not _alive(p)]
        if dead or time.monotonic() > deadline:
            tails = "\n".join(f"--- {p}:\n{Path(p).read_text()[-2000:]}" for p in logs if Path(p).exists())
            pytest.fail(f"{what}: {'process ' + str(dead) + ' died' if dead else f'not within {timeout} s'}\n{tails}")
        time.sleep(0.3)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    with open(f"/proc/{pid}/stat") as f:  # a zombie is dead too
        return f.read().rsplit(")", 1)[1].split()[0] != "Z"


class TwoHosts:
    def __init__(self, root: Path) -> None:
        tag = f"dprl{os.getpid() % 100000}"
        self.ns = {"a": f"{tag}a", "b": f"{tag}b"}
        self.ip = {"a": HEAD, "b": WORKER}
        self.root = root
        self.dirs = {n: root / n for n in self.ns}
        self.home = root / "home"  # `ray get-auth-token --generate` writes $HOME/.ray/auth_token: not the user's
        # short: Ray's socket paths under it must stay within AF_UNIX's 107 bytes
        self.ray_tmp = Path(tempfile.mkdtemp(prefix="dprl-mh-", dir="/tmp"))
        self.env = {"HEAD": HEAD, "SEGMENT": str(SEGMENT), "PYTHONPATH": str(REPO), "RAY_TMPDIR": str(self.ray_tmp)}

    def ip_cmd(self, *args: str) -> None:
        subprocess.run(["ip", *args], check=True, capture_output=True, timeout=30)

    def up(self) -> None:
        a, b = self.ns["a"], self.ns["b"]
        self.ip_cmd("netns", "add", a)
        self.ip_cmd("netns", "add", b)
        self.ip_cmd("link", "add", f"{a}v", "netns", a, "type", "veth", "peer", "name", f"{b}v", "netns", b)
        for n in "ab":
            ns = self.ns[n]
            self.ip_cmd("-n", ns, "addr", "add", f"{self.ip[n]}/24", "dev", f"{ns}v")
            self.ip_cmd("-n", ns, "link", "set", f"{ns}v", "up")
            self.ip_cmd("-n", ns, "link", "set", "lo", "up")
            self.dirs[n].mkdir(parents=True)
            (self.dirs[n] / "configs").symlink_to(REPO / "configs")  # as if each node ran from the repo root
        self.home.mkdir()

    def sh(self, node: str, cmd: str, timeout: float = 60, check: bool = True, **env: str):
        p = subprocess.run(["ip", "netns", "exec", self.ns[node], "bash", "-c", cmd], cwd=self.dirs[node],
                           env={**os.environ, **self.env, **env}, capture_output=True, text=True, timeout=timeout)
        if check and p.returncode:
            pytest.fail(f"on host {node}: `{cmd}` exited {p.returncode}\n{p.stdout[-3000:]}\n{p.stderr[-3000:]}")
        return p

    def pid(self, node: str, name: str) -> int:
        return int((self.dirs[node] / f"{name}.pid").read_text())

    def listening(self, node: str, port: int) -> bool:
        out = self.sh(node, f"ss -ltnH 'sport = :{port}'").stdout
        return bool(out.strip())

    def nodes_alive(self) -> int:
        code = "import ray; ray.init(address='auto', logging_level='ERROR'); print(sum(n['Alive'] for n in ray.nodes()))"
        p = self.sh("a", f"{sys.executable} -c \"{code}\"", check=False)
        return int(p.stdout.strip().splitlines()[-1]) if p.returncode == 0 and p.stdout.strip() else 0

    def start(self) -> None:
        d = self.dirs
        token = self.sh("a", f"{RECIPE['token']}; echo $RAY_AUTH_TOKEN", HOME=str(self.home)).stdout.split()[-1]
        self.env.update(RAY_AUTH_MODE="token", RAY_AUTH_TOKEN=token)
        self.sh("a", RECIPE["ray_head"])
        _wait("ray head", lambda: (Path(self.env["RAY_TMPDIR"]) / "ray" / "ray_current_cluster").exists(),
              [self.pid("a", "ray")], logs=[d["a"] / "ray.log"])
        self.sh("a", RECIPE["master"])
        _wait("mooncake master", lambda: self.listening("a", 50052), [self.pid("a", "master")],
              logs=[d["a"] / "master.log"])
        # RPC and admin (key listing) ports bind the head's IP, not 0.0.0.0
        listen = self.sh("a", "ss -ltnH '( sport = :50051 or sport = :50052 )'").stdout.split("\n")
        assert sorted(ln.split()[3] for ln in listen if ln.strip()) == [f"{HEAD}:50051", f"{HEAD}:50052"], listen
        self.sh("b", RECIPE["ray_worker"])
        for n in "ab":
            self.sh(n, RECIPE["holder"])
        _wait("ray worker joins", lambda: self.nodes_alive() == 2, [self.pid("b", "ray")], logs=[d["b"] / "ray.log"])
        get = f"import urllib.request as u; print(u.urlopen('http://{HEAD}:50052/get_all_segments').read().decode())"
        segments = lambda: self.sh("a", f"{sys.executable} -c \"{get}\"").stdout.split()  # noqa: E731
        _wait("both holders mounted", lambda: len(segments()) == 2, [self.pid(n, "holder") for n in "ab"],
              logs=[d[n] / "holder.log" for n in "ab"])
        # each holder advertises its own host's address, never 127.0.0.1
        assert sorted(s.rsplit(":", 1)[0] for s in segments()) == [HEAD, WORKER]

    def down(self) -> None:
        """SIGTERM what the recipe started (its teardown), then SIGKILL whatever is left in the namespaces."""
        for n in "ab":
            if (self.dirs[n] / "ray.pid").exists():
                self.sh(n, RECIPE["stop"] + (f"; {RECIPE['stop_master']}" if n == "a" else ""), check=False)
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline and any(self.pids(n) for n in "ab"):
            time.sleep(0.3)
        for n in "ab":
            for pid in self.pids(n):
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
        for n in "ab":
            subprocess.run(["ip", "netns", "del", self.ns[n]], capture_output=True, timeout=30)
        shutil.rmtree(self.ray_tmp, ignore_errors=True)  # also the stale ray_current_cluster a test puts there

    def pids(self, node: str) -> list[int]:
        p = subprocess.run(["ip", "netns", "pids", self.ns[node]], capture_output=True, text=True, timeout=30)
        return [int(x) for x in p.stdout.split()] if p.returncode == 0 else []


@pytest.fixture(scope="module")
def hosts(tmp_path_factory):
    if os.geteuid() != 0 or not shutil.which("ip") or not shutil.which("ss"):
        backend_unavailable("multihost", "needs root with `ip` and `ss` to make network namespaces")
    stale = Path("/tmp/ray/ray_current_cluster")
    before = stale.read_text() if stale.exists() else None
    h = TwoHosts(tmp_path_factory.mktemp("hosts"))
    try:
        h.up()
        h.start()
        yield h
    finally:
        h.down()
        after = stale.read_text() if stale.exists() else None
        assert after == before, "the namespaced Ray nodes wrote /tmp/ray/ray_current_cluster"


def test_run_over_two_hosts_matches_one_host(hosts):
    p = hosts.sh("a", RECIPE["train"] + " logger.progress=false", timeout=400, check=False)
    assert p.returncode == 0, (p.stdout + p.stderr)[-4000:]
    run_dir = hosts.dirs["a"] / "runs" / "latest"
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["status"] == "completed"
    nodes = summary["nodes"]
    assert sorted(nodes["rollout"]) == [HEAD, WORKER] and sorted(nodes["train"]) == [HEAD, WORKER], nodes
    assert hosts.sh("a", RECIPE["placement"]).stdout.strip() == str(nodes)
    multi = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert len(multi) == 2

    assert not GLOG_LINE.search(p.stdout + p.stderr), "Mooncake glog lines in the run's output"

    # The same config on this one host (its own local Mooncake store), from the CLI, with a dead
    # `ray start`'s ray_current_cluster where Ray looks: the run must start its own Ray, not join it.
    args = RECIPE["train"].split()
    one_dir = hosts.root / "one-host"
    stale = hosts.ray_tmp / "stale"
    (stale / "ray").mkdir(parents=True)
    (stale / "ray" / "ray_current_cluster").write_text("127.0.0.1:9")  # nothing listens on port 9
    env = {k: v for k, v in os.environ.items() if k not in ("RAY_ADDRESS", "RAY_AUTH_MODE", "MC_LOG_LEVEL")}
    cmd = [sys.executable, "-m", "dataplane_rl.cli.main", *args[1:], "data_plane.backend=mooncake://",
           f"logger.run_dir={one_dir}", "logger.progress=false"]
    cmd.remove("cluster.address=auto")
    cmd.remove("data_plane.backend=mooncake://$HEAD:50051")
    p = subprocess.run(cmd, cwd=REPO, env={**env, "PYTHONPATH": str(REPO), "RAY_TMPDIR": str(stale)},
                       capture_output=True, text=True, timeout=400)
    out = p.stdout + p.stderr
    assert p.returncode == 0, out[-4000:]
    assert not GLOG_LINE.search(out), f"Mooncake glog lines in a normal run:\n{out[-3000:]}"
    assert "Token authentication" not in out, out[-3000:]
    one = [json.loads(x) for x in (one_dir / "metrics.jsonl").read_text().splitlines()]
    assert_close(multi[0], one[0])


def test_shm_refused_on_a_two_node_cluster(hosts):
    p = hosts.sh("a", "dataplane-rl train cluster.address=auto data_plane.enabled=true data_plane.backend=shm:// "
                 f"grpo.max_num_steps=1 {TINY} logger.run_dir=runs/shm", timeout=120, check=False)
    out = p.stdout + p.stderr
    assert p.returncode != 0 and "data_plane.backend=shm://" in out and "mooncake://" in out, out[-3000:]
    assert json.loads((hosts.dirs["a"] / "runs" / "shm" / "summary.json").read_text())["status"] == "failed"


def test_holder_killed_on_the_other_host_leaves_a_consistent_run(hosts):
    """Run last in this module: it kills host B's holder after the run's first step. Where the kill lands decides
    what follows, and both are right: a step whose blocks were on B cannot be read, so the run stops with the lost
    store named (exit 2); a step whose blocks were not yet written goes on, the store retrying the dead holder's
    TRANSFER_FAIL (store/mooncake/retry.py) until the master drops its segment, then writing to A's, and the run
    ends. Either way every logged step is whole, and no other exit is accepted."""
    steps = 60
    run_dir = hosts.dirs["a"] / "runs" / "fault"
    cmd = RECIPE["train"].replace("grpo.max_num_steps=2", f"grpo.max_num_steps={steps}") + \
        " logger.progress=false logger.run_dir=runs/fault"
    proc = subprocess.Popen(["ip", "netns", "exec", hosts.ns["a"], "bash", "-c", cmd], cwd=hosts.dirs["a"],
                            env={**os.environ, **hosts.env}, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        metrics = run_dir / "metrics.jsonl"
        _wait("first step of the fault run", lambda: metrics.is_file() and metrics.read_text(), [proc.pid], timeout=300)
        os.kill(hosts.pid("b", "holder"), signal.SIGKILL)
        out, _ = proc.communicate(timeout=300)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate(timeout=30)
    if proc.returncode != 0:
        assert_store_failure_left_a_consistent_run(proc.returncode, out, run_dir)
        return
    summary = json.loads((run_dir / "summary.json").read_text())
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    assert summary["status"] == "completed" and summary["steps_completed"] == len(lines) == steps, out[-3000:]
    assert [json.loads(x)["step"] for x in lines] == list(range(1, steps + 1))
    assert len(list((run_dir / "train_data").glob("step_*.jsonl"))) == steps
