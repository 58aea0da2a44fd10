"""Where the run's actors go: Ray placement groups over the cluster's nodes, and the refusals before start.

Rollout actors form one placement group and train workers another, each with `cluster.placement_strategy`
(SPREAD by default: as many nodes as Ray can). Each actor is pinned to its own bundle. A bundle must ask
for some resource, so it asks for a token CPU share (BUNDLE_CPU): the phases run one after another, so
actors share the cores instead of reserving them. Train workers (and vLLM rollout actors) on CUDA ask
for one GPU each.
"""

from __future__ import annotations

import os

from dataplane_rl.config import Config
from dataplane_rl.errors import ConfigError, StoreUnavailableError

BUNDLE_CPU = 0.01
READY_TIMEOUT_S = 120.0


def check_store_reachable(cfg: Config) -> None:
    """Before Ray starts: a `mooncake://HOST:PORT` master must accept connections from the driver's node."""
    url = cfg.data_plane.url or ""
    if not url.startswith("mooncake://"):
        return
    address = url[len("mooncake://"):].partition("?")[0]
    if not address:
        return  # the run starts its own master
    from dataplane_rl.store.mooncake.client import port_open, split_address

    split_address(address)  # StoreUnavailableError unless HOST:PORT
    if not port_open(address, timeout=5.0):
        raise StoreUnavailableError(
            f"data_plane.backend={url}: no Mooncake master accepts connections at {address} from this node "
            "(waited 5 s); start mooncake_master there (docs/cluster.md) or fix the address")


def alive_nodes() -> list[dict]:
    import ray

    return [n for n in ray.nodes() if n.get("Alive")]


def check_backend_spans(cfg: Config, nodes: list[dict]) -> None:
    """Refuse a store that only one machine can reach when actors may be placed on other nodes."""
    url = cfg.data_plane.url
    if url is None or len(nodes) < 2:
        return
    ips = sorted(n["NodeManagerAddress"] for n in nodes)
    where = f"the Ray cluster has {len(nodes)} nodes ({', '.join(ips)}) and actors may be placed on any of them"
    if url.startswith("shm://"):
        raise ConfigError(f"data_plane.backend={url} keeps the columns in this machine's /dev/shm, but {where}; use "
                          "data_plane.backend=mooncake://HEAD:PORT (a Mooncake master and a holder on every node, "
                          "see docs/cluster.md), or data_plane.enabled=false")
    if url.startswith("mooncake://"):
        from dataplane_rl.hosts import is_loopback

        host = url[len("mooncake://"):].partition("?")[0].rpartition(":")[0]
        if not host or is_loopback(host):
            what = "starts a master and holders on this machine's 127.0.0.1" if not host else "names a loopback master"
            raise ConfigError(f"data_plane.backend={url} {what}, which other nodes cannot reach, but {where}; start "
                              "a master on the head node's IP and a holder on every node (docs/cluster.md) "
                              "and set data_plane.backend=mooncake://HEAD:PORT")


def gpu_plan(cfg: Config) -> tuple[int, int]:
    """GPUs per (rollout actor, train worker): 1 each on CUDA when the cluster has enough, else 0."""
    import ray

    if cfg.policy.device == "cpu":
        return 0, 0
    gpus = ray.cluster_resources().get("GPU", 0)
    train = 1 if gpus >= cfg.policy.dp_size else 0
    left = gpus - train * cfg.policy.dp_size
    rollout = 1 if cfg.generation.backend == "vllm" and left >= cfg.generation.num_workers else 0
    return rollout, train


def placement_group(name: str, count: int, gpus: int, cfg: Config, nodes: list[dict]):
    """A ready placement group of `count` bundles (one per actor), or ConfigError naming the strategy."""
    import ray
    from ray.util.placement_group import placement_group as make, remove_placement_group

    strategy = cfg.cluster.placement_strategy
    if strategy == "STRICT_SPREAD" and count > len(nodes):
        raise ConfigError(f"cluster.placement_strategy=STRICT_SPREAD needs a node per {name} actor ({count}), but the "
                          f"Ray cluster has {len(nodes)} node(s); use SPREAD or PACK, or fewer actors")
    bundle = {"CPU": BUNDLE_CPU, **({"GPU": gpus} if gpus else {})}
    pg = make([dict(bundle) for _ in range(count)], strategy=strategy, name=f"dataplane-rl-{name}-{os.getpid()}")
    try:
        ray.get(pg.ready(), timeout=READY_TIMEOUT_S)
    except ray.exceptions.GetTimeoutError:
        remove_placement_group(pg)
        raise ConfigError(f"Ray could not place {count} {name} actors ({bundle} each) with "
                          f"cluster.placement_strategy={strategy} within {READY_TIMEOUT_S:.0f} s; the cluster has "
                          f"{ray.cluster_resources()}") from None
    return pg


def options(pg, index: int, gpus: int) -> dict:
    """ray.remote options that pin an actor to bundle `index` of `pg`."""
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    return {"num_cpus": BUNDLE_CPU, "num_gpus": gpus,
            "scheduling_strategy": PlacementGroupSchedulingStrategy(pg, placement_group_bundle_index=index)}


def _node_ip(_actor) -> str:
    import ray

    return ray.util.get_node_ip_address()


def _pin_gloo_interface(_actor) -> str | None:
    """Make gloo use the interface of this node's Ray IP. Without it gloo takes the address the hostname
    resolves to, and falls back to loopback when that is not usable, so ranks on other hosts cannot connect."""
    import ray

    from dataplane_rl.hosts import interface_of

    iface = interface_of(ray.util.get_node_ip_address())
    if iface and "GLOO_SOCKET_IFNAME" not in os.environ:
        os.environ["GLOO_SOCKET_IFNAME"] = iface
    return os.environ.get("GLOO_SOCKET_IFNAME")


def _pid(_actor) -> int:
    return os.getpid()


def pids(actors: list) -> list[int]:
    """The process id of each actor, in order."""
    import ray

    return ray.get([a.__ray_call__.remote(_pid) for a in actors])


def node_ips(actors: list) -> list[str]:
    """The node IP each actor runs on, in order."""
    import ray

    return ray.get([a.__ray_call__.remote(_node_ip) for a in actors])


def pin_gloo_interfaces(actors: list) -> None:
    import ray

    ray.get([a.__ray_call__.remote(_pin_gloo_interface) for a in actors])
