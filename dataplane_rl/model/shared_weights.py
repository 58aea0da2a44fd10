"""A policy's weights published once in shared memory, read in place by the rollout actors of the trainer's node.

A refit through the object store copies the whole policy twice: rank 0's state dict into the object store, and from
there into every rollout actor's own parameters (538 MB each time for SmolLM2-135M, and an actor then holds a
private copy for good). On one node neither copy is needed: rank 0 writes a version's tensors end to end into one
file in shared memory (/dev/shm), and each actor on that node maps the file and makes its parameters views of it
(`attach`). The weights then exist once for all of the node's actors, and a refit is one copy on the trainer and
none on the actors.

Each version is a file of its own, written under a temporary name and renamed, so an actor maps whole versions only,
and writing version N never changes version N-1 under an actor that still generates with it. An unlinked file lives
on while an actor maps it, so rank 0 unlinks every version that no open job needs as it publishes the next. The
folder is an auto-made shm folder with an owner record (store/owners.py): a clean close removes it, and a killed
trainer's folder goes at the next `train` start or `dataplane-rl store gc`.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import socket
import uuid
from dataclasses import dataclass

import torch

from dataplane_rl.store import owners
from dataplane_rl.store.files import create_file

ALIGN = 64  # every tensor starts on a cache line, so a byte range views as any dtype
FILE_MODE = 0o600  # the weights are the run's own (docs/security.md: private files)


@dataclass(frozen=True)
class SharedWeights:
    """One published version: where its file is, on which machine, and each tensor's place in it."""

    version: int
    path: str
    host: str              # the trainer's machine (hostname and boot): only a process there can map the file
    boot: str | None
    nbytes: int
    entries: tuple[tuple[str, str, tuple[int, ...], int], ...]  # (state-dict key, dtype name, shape, byte offset)

    def here(self) -> bool:
        """Whether this process runs where the file is (same machine, same boot) and the file is still there."""
        return (self.host, self.boot) == (socket.gethostname(), _boot()) and os.path.exists(self.path)


def _boot() -> str | None:
    return owners.this_owner()["boot"]


def _dtype(name: str) -> torch.dtype:
    dtype = getattr(torch, name.removeprefix("torch."), None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"shared weights: unknown dtype {name!r}")
    return dtype


def _map(path: str, nbytes: int) -> torch.Tensor:
    """The file's bytes as a uint8 tensor over a MAP_SHARED mapping: no copy, pages shared with every mapper."""
    return torch.from_file(path, shared=True, size=nbytes, dtype=torch.uint8)


class WeightsFolder:
    """Rank 0's versions in shared memory: `publish` one, unlinking those no open job needs."""

    def __init__(self) -> None:
        self.folder: str | None = None  # made at the first publish
        self.versions: dict[int, str] = {}  # version -> file

    def _make(self) -> str:
        folder = owners.new_auto_path()
        os.makedirs(folder, mode=0o700)
        owners.write_owner(folder, auto=True)  # before the marker: collectable as soon as it is a folder of ours
        create_file(os.path.join(folder, owners.MARKER), b"shared weights\n")
        return folder

    def publish(self, state_dict: dict[str, torch.Tensor], version: int, keep: set[int] = frozenset()) -> SharedWeights:
        """Write `state_dict` as `version`; then unlink every older version not in `keep` (an actor that maps one
        keeps its pages until it lets go). Tensors that share storage (tied embeddings) are written once."""
        self.folder = self.folder or self._make()
        entries, places, offset = [], {}, 0
        for key, t in state_dict.items():
            where = (t.untyped_storage().data_ptr(), t.storage_offset(), tuple(t.shape), tuple(t.stride()), t.dtype)
            if where not in places:
                places[where] = offset
                offset += -(-t.numel() * t.element_size() // ALIGN) * ALIGN
            entries.append((key, str(t.dtype), tuple(t.shape), places[where]))
        nbytes = max(offset, ALIGN)
        path = os.path.join(self.folder, f"v{version:06d}")
        tmp = os.path.join(self.folder, f".v{version:06d}-{uuid.uuid4().hex[:8]}")
        fd = os.open(tmp, os.O_RDWR | os.O_CREAT | os.O_EXCL, FILE_MODE)
        try:
            os.ftruncate(fd, nbytes)
        finally:
            os.close(fd)
        try:
            flat = _map(tmp, nbytes)
            written = set()
            for (key, dtype, shape, off), t in zip(entries, state_dict.values()):
                if off not in written:
                    written.add(off)
                    n = t.numel() * t.element_size()
                    flat[off:off + n].view(t.dtype).view(shape).copy_(t.detach())
            del flat
            os.rename(tmp, path)
        except BaseException:
            with contextlib.suppress(OSError):
                os.unlink(tmp)
            raise
        self.versions[version] = path
        for v in [v for v in self.versions if v != version and v not in keep]:
            with contextlib.suppress(OSError):
                os.unlink(self.versions.pop(v))
        owner = owners.this_owner()
        return SharedWeights(version, path, owner["host"], owner["boot"], nbytes, tuple(entries))

    def close(self) -> None:
        """Remove the folder (actors that still map a version keep its pages until they let go)."""
        if self.folder:
            shutil.rmtree(self.folder, ignore_errors=True)
        self.folder, self.versions = None, {}


def attach(shared: SharedWeights) -> dict[str, torch.Tensor]:
    """The version's tensors as views of its mapped file, keyed as the state dict was (no copy)."""
    if not shared.here():
        raise RuntimeError(f"the shared weights of version {shared.version} ({shared.path}, on {shared.host}) are not "
                           f"on this machine ({socket.gethostname()}) or were removed; a rollout actor on another node "
                           "takes its weights through the object store")
    flat = _map(shared.path, shared.nbytes)
    out = {}
    for key, dtype, shape, off in shared.entries:
        dt = _dtype(dtype)
        n = dt.itemsize
        for d in shape:
            n *= d
        out[key] = flat[off:off + n].view(dt).view(shape)
    return out

