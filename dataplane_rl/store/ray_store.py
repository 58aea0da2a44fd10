"""`ray://[HOST:PORT][/NAME]`: columns in the Ray object store, the baseline users would otherwise pick.

`ray://` uses the Ray this process is in, else starts a local one of its own (never the cluster
/tmp/ray/ray_current_cluster names, which may be dead or another user's); `ray://HOST:PORT` joins that
cluster, within a bound (ray_calls.init). NAME (default "default") picks a catalog, so several stores can
share one cluster.

Chunk bytes are Ray objects. A named, detached catalog actor (`dataplane-rl-catalog-NAME` in namespace
`dataplane-rl`) holds partition metas, committed refs and the ObjectRefs of their bytes.

Ownership: a Ray object dies with the process that owns it (the one that called ray.put), and writers
(rollout workers, a CLI) come and go. Ray 2.56 removed `ray.put(_owner=...)`, so the catalog copies each
committed chunk into an object it owns itself: writer-owned bytes live only until the commit, and the
data then lives as long as the catalog actor, freed when the partition is dropped.

Commit is a compare-and-swap on the partition's version: the writer checks conflicts (the `conflict`
function the store hands `commit`) against the refs it read, and the catalog accepts only if no other put committed since;
otherwise the writer re-checks against the refs the catalog returns. The catalog is one single-threaded
actor: every committed byte passes through it, which is part of why this is a baseline.
"""

from __future__ import annotations

import logging
import socket
import uuid
from typing import Any

import numpy as np
import pyarrow as pa
import ray

from dataplane_rl.errors import (
    ConfigError,
    PartitionExistsError,
    StoreUnavailableError,
)
from dataplane_rl.ray_calls import init
from dataplane_rl.store import chunks
from dataplane_rl.store.base import ColumnStore
from dataplane_rl.store.chunks import ChunkRef, PartitionMeta, Snapshot
from dataplane_rl.store.storage import Staged, Storage

NAMESPACE = "dataplane-rl"
_TIMEOUT_S = 300.0


class _Catalog:
    """The catalog actor: partition metas, committed refs (JSON) and the ObjectRefs it owns."""

    def __init__(self) -> None:
        self.metas: dict[str, str] = {}
        self.refs: dict[str, list[dict]] = {}
        self.version: dict[str, int] = {}
        self.objs: dict[str, dict[str, Any]] = {}  # pid -> chunk key -> ObjectRef owned here

    def create(self, pid: str, meta_json: str) -> bool:
        if pid in self.metas:
            return False
        self.metas[pid], self.refs[pid], self.version[pid], self.objs[pid] = meta_json, [], 0, {}
        return True

    def meta(self, pid: str) -> str | None:
        return self.metas.get(pid)

    def chunks(self, pid: str) -> tuple[int, list[dict]] | None:
        return (self.version[pid], self.refs[pid]) if pid in self.metas else None

    def commit(self, pid: str, version: int, refs: list[dict], objs: list) -> tuple[str, int, list[dict]]:
        """'ok', 'retry' (someone committed since `version`; re-check against the refs returned) or
        'gone'. `objs` arrive nested in a list, so as ObjectRefs owned by the writer."""
        if pid not in self.metas:
            return "gone", 0, []
        if version != self.version[pid]:
            return "retry", self.version[pid], self.refs[pid]
        owned = [ray.put(v) for v in ray.get(objs)]  # the writer-owned bytes die with the writer
        for ref, obj in zip(refs, owned):
            self.objs[pid][ref["key"]] = obj
        self.refs[pid] = self.refs[pid] + refs
        self.version[pid] += 1
        return "ok", self.version[pid], []

    def objects(self, pid: str, keys: list[str]) -> list | None:
        if pid not in self.metas:
            return None
        return [self.objs[pid].get(k) for k in keys]

    def drop(self, pid: str) -> bool:
        if pid not in self.metas:
            return False
        for table in (self.metas, self.refs, self.version, self.objs):
            del table[pid]  # the last owned reference goes: Ray frees the bytes
        return True

    def list(self) -> list[str]:
        return list(self.metas)



def _on_this_machine(address: str) -> bool:
    host = address.rsplit(":", 1)[0].strip("[]")
    try:
        with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET) as s:
            s.bind((host, 0))  # succeeds only for an address of this machine
        return True
    except OSError:
        return False


def _use_local_token() -> None:
    """Ray quirk: a local cluster turns token auth on, and ray.init(address="auto") then sends the local
    token (~/.ray/auth_token), but ray.init(address=HOST:PORT) never does, so a second process could not
    join by URL. Do what "auto" does, only for a cluster on this machine."""
    try:
        from ray._private.authentication.authentication_token_setup import (
            maybe_enable_token_auth_if_token_available,
        )
    except ImportError:  # a Ray without token auth
        return
    maybe_enable_token_auth_if_token_available(warn_if_disabled=False)


def _connect(address: str | None) -> None:
    if ray.is_initialized():
        return  # inside a Ray worker or a driver that already joined: use that cluster
    if address and _on_this_machine(address):
        _use_local_token()
    if address:
        fix = (f"start it (`ray start --head --port={address.rpartition(':')[2]}`) or give the address `ray start` "
               "printed; ray:// without an address starts a local Ray of this process's own")
        init(address, StoreUnavailableError, fix, logging_level=logging.WARNING, log_to_driver=False)
    else:
        init(None, StoreUnavailableError, "Ray's logs are under /tmp/ray/session_latest/logs",
             include_dashboard=False, logging_level=logging.WARNING, log_to_driver=False)


class RayStore(ColumnStore):
    scheme = "ray"

    def __init__(self, address: str | None = None, name: str = "default") -> None:
        super().__init__(RayStorage(address, name))

    @classmethod
    def from_url(cls, rest: str, **options: Any) -> "RayStore":
        address, _, name = rest.partition("/")
        return cls(address or None, name or "default", **options)


class RayStorage(Storage):
    """Block bytes as Ray objects, metas and committed refs in the catalog actor."""

    def __init__(self, address: str | None, name: str) -> None:
        if not name or "/" in name:
            raise ConfigError(f"ray store name {name!r} is invalid; use ray://[HOST:PORT][/NAME] with a plain NAME")
        _connect(address)
        self._name = name
        self._address = ray.get_runtime_context().gcs_address
        actor_name = f"dataplane-rl-catalog-{name}"
        try:
            cls = ray.remote(num_cpus=0, max_restarts=0)(_Catalog)
            self._catalog = cls.options(name=actor_name, namespace=NAMESPACE, lifetime="detached",
                                        get_if_exists=True).remote()
        except Exception as e:
            raise StoreUnavailableError(f"cannot start the catalog actor {actor_name}: {e}") from e
        self._pending: dict[str, Any] = {}  # chunk key -> writer-owned ObjectRef until committed

    @property
    def url(self) -> str:
        return f"ray://{self._address}/{self._name}"

    def _call(self, method: str, *args: Any) -> Any:
        try:
            return ray.get(getattr(self._catalog, method).remote(*args), timeout=_TIMEOUT_S)
        except (ray.exceptions.RayActorError, ray.exceptions.GetTimeoutError) as e:
            raise StoreUnavailableError(f"the catalog of {self.url} is unreachable ({type(e).__name__}); its "
                                        "partitions are lost if the actor died: re-create them") from e

    # -- catalog ---------------------------------------------------------------------------
    def create(self, meta: PartitionMeta) -> None:
        if not self._call("create", meta.pid, meta.to_json()):
            raise PartitionExistsError(f"partition {meta.pid} already exists in {self.url}; drop it first or "
                                       "use a new id")

    def _fetch(self, pid: str) -> tuple[int, list[ChunkRef]]:
        got = self._call("chunks", pid)
        if got is None:
            raise self.not_found(pid)
        return got[0], [ChunkRef.from_json(d) for d in got[1]]

    def snapshot(self, pid: str) -> Snapshot:
        text = self._call("meta", pid)
        if text is None:
            raise self.not_found(pid)
        return Snapshot(PartitionMeta.from_json(text), self._fetch(pid)[1])

    def store(self, meta: PartitionMeta, blocks) -> Staged:
        refs: list[ChunkRef] = []
        try:
            for block in blocks:
                buf, digests = chunks.encode_block(block)
                ref = ChunkRef.of(block, f"{meta.pid}/{uuid.uuid4().hex}", digests)
                self._pending[ref.key] = ray.put(np.frombuffer(buf, dtype=np.uint8))
                refs.append(ref)
        except BaseException:
            self.discard(meta, refs)
            raise
        return Staged(refs)

    def commit(self, meta: PartitionMeta, staged: Staged, seen, conflict) -> None:
        pid, refs = meta.pid, staged.refs
        version, committed = self._fetch(pid)
        payload = [r.to_json() for r in refs]
        objs = [self._pending[r.key] for r in refs]
        while True:
            err = conflict(Snapshot(meta, committed), refs)
            if err:
                raise err
            status, version, current = self._call("commit", pid, version, payload, objs)
            if status == "gone":
                raise self.not_found(pid)
            if status == "ok":
                break
            committed = [ChunkRef.from_json(d) for d in current]
        for r in refs:
            self._pending.pop(r.key, None)

    def discard(self, meta: PartitionMeta, refs: list[ChunkRef]) -> None:
        for r in refs:
            self._pending.pop(r.key, None)  # the writer-owned object goes with its last reference

    def read(self, pid: str, refs: list[ChunkRef]) -> list[pa.Buffer]:
        objs = self._call("objects", pid, [r.key for r in refs])
        if objs is None:
            raise self.not_found(pid)
        out: list[pa.Buffer] = []
        for obj in objs:
            try:
                out.append(pa.py_buffer(b"" if obj is None else ray.get(obj, timeout=_TIMEOUT_S)))
            except (ray.exceptions.ObjectLostError, ray.exceptions.GetTimeoutError):
                out.append(pa.py_buffer(b""))  # lost or evicted: the checksum check reports it as missing
        return out

    def drop(self, pid: str) -> None:
        if not self._call("drop", pid):
            raise self.not_found(pid)

    def list(self) -> list[str]:
        return self._call("list")

    def close(self) -> None:
        # The catalog and its data outlive this handle (it is detached); other processes may still read.
        self._pending.clear()
