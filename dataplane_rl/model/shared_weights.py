"""A policy's weights published once in shared memory, read in place by the rollout actors of the trainer's node.

A refit through the object store copies the whole policy twice: rank 0's state dict into the object store, and from
there into every rollout actor's own parameters (538 MB each time for SmolLM2-135M, and an actor then holds a
private copy for good). On one node neither copy is needed: rank 0 writes a version's tensors end to end into one
file in shared memory (/dev/shm), and each actor on that node maps the file and makes its parameters views of it
(`attach`). The weights then exist once for all of the node's actors, and a refit is one copy on the trainer and
none on the actors.

Each version is a file of its own, written under a temporary name and renamed, so an actor maps whole versions only,
and writing version N never changes version N-1 under an actor that still generates with it. Where no actor can
read while the trainer writes (synchronous steps on one rank, nothing in flight: the driver decides), `publish_live`
goes further: the trainer's own parameters move into the file once, the optimizer updates them there, and a refit
copies nothing at all. An unlinked file lives
on while an actor maps it, so rank 0 unlinks every version that no open job needs as it publishes the next. The
folder is an auto-made shm folder with an owner record (store/shm/owners.py): a clean close removes it, and a killed
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

from dataplane_rl.store.shm import owners
from dataplane_rl.store.shm.files import create_file

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
    live: bool = False     # the trainer's own tensors (publish_live): every version is this file, changed in place

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
        self.live: tuple | None = None  # publish_live's (path, mapping, entries, nbytes)

    def _make(self) -> str:
        folder = owners.new_auto_path()
        os.makedirs(folder, mode=0o700)
        owners.write_owner(folder, auto=True)  # before the marker: collectable as soon as it is a folder of ours
        create_file(os.path.join(folder, owners.MARKER), b"shared weights\n")
        return folder

    def publish(self, state_dict: dict[str, torch.Tensor], version: int, keep: set[int] = frozenset()) -> SharedWeights:
        """Write `state_dict` as `version`; then unlink every older version not in `keep` (an actor that maps one
        keeps its pages until it lets go). Tensors that share storage (tied embeddings) are written once."""
        self.live = None  # a copy from here on: the trainer's tensors may change under the last live file
        entries, nbytes = _layout(state_dict)
        path = os.path.join(self._folder(), f"v{version:06d}")
        tmp = os.path.join(self._folder(), f".v{version:06d}-{uuid.uuid4().hex[:8]}")
        try:
            flat = _new_file(tmp, nbytes)
            written = set()
            for (key, dtype, shape, off), t in zip(entries, state_dict.values()):
                if off not in written:
                    written.add(off)
                    _at(flat, off, t).copy_(t.detach())
            del flat
            os.rename(tmp, path)
        except BaseException:
            with contextlib.suppress(OSError):
                os.unlink(tmp)
            raise
        self.versions[version] = path
        self._unlink_except({version} | set(keep))
        return _shared(version, path, nbytes, entries)

    def publish_live(self, model: torch.nn.Module, version: int) -> SharedWeights:
        """`model`'s own parameters and persistent buffers as the shared file, for a refit no actor can read during
        (the caller's promise: synchronous steps, one rank, no job in flight). The first call moves each tensor into
        one file (the module's tensors become views of it: the optimizer then updates the file in place); later
        calls copy nothing but a tensor something replaced since (a checkpoint load), which is moved in again.
        Every version is this one file: older version files are unlinked."""
        state = model.state_dict()  # detached views of the module's own tensors, keyed as the actors' are
        owned = {name: t for name, t in [*model.named_parameters(remove_duplicate=False),
                                          *model.named_buffers(remove_duplicate=False)]}
        if not set(state) <= set(owned) or any(t.device.type != "cpu" or type(t) not in (torch.Tensor, torch.nn.Parameter)
                                                for t in owned.values()):
            raise ValueError("publish_live needs a module whose state dict is its own CPU tensors")
        entries, nbytes = _layout(state)
        if self.live is None or [e[:3] for e in self.live[2]] != [e[:3] for e in entries]:
            path = os.path.join(self._folder(), f"live-{uuid.uuid4().hex[:8]}")
            self.live = (path, _new_file(path, nbytes), entries, nbytes)
        path, flat, entries, nbytes = self.live
        for key, _, _, off in entries:
            t = owned[key]
            view = _at(flat, off, t)
            if t.data_ptr() != view.data_ptr():
                view.copy_(t.detach())
                t.data = view  # a tied tensor is moved once: its other key then finds it in place
        self.versions[version] = path
        self._unlink_except({version})
        return _shared(version, path, nbytes, entries, live=True)

    def _folder(self) -> str:
        self.folder = self.folder or self._make()
        return self.folder

    def _unlink_except(self, keep: set[int]) -> None:
        live = self.live[0] if self.live else None
        for v in [v for v in self.versions if v not in keep]:
            path = self.versions.pop(v)
            if path != live:
                with contextlib.suppress(OSError):
                    os.unlink(path)

    def close(self) -> None:
        """Remove the folder (actors that still map a version keep its pages until they let go)."""
        if self.folder:
            shutil.rmtree(self.folder, ignore_errors=True)
        self.folder, self.versions = None, {}  # a live mapping stays while the module's tensors view it


def _layout(state_dict: dict[str, torch.Tensor]) -> tuple[list[tuple[str, str, tuple[int, ...], int]], int]:
    """Each tensor's place in a file: (key, dtype name, shape, byte offset); tensors sharing storage (tied
    embeddings) share a place. And the file's size."""
    entries, places, offset = [], {}, 0
    for key, t in state_dict.items():
        where = (t.untyped_storage().data_ptr(), t.storage_offset(), tuple(t.shape), tuple(t.stride()), t.dtype)
        if where not in places:
            places[where] = offset
            offset += -(-t.numel() * t.element_size() // ALIGN) * ALIGN
        entries.append((key, str(t.dtype), tuple(t.shape), places[where]))
    return entries, max(offset, ALIGN)


def _new_file(path: str, nbytes: int) -> torch.Tensor:
    """A new private file of `nbytes` in shared memory, mapped."""
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, FILE_MODE)
    try:
        os.ftruncate(fd, nbytes)
    finally:
        os.close(fd)
    return _map(path, nbytes)


def _at(flat: torch.Tensor, off: int, like: torch.Tensor) -> torch.Tensor:
    """The bytes at `off` of a mapped file as a tensor of `like`'s dtype and shape."""
    return flat[off:off + like.numel() * like.element_size()].view(like.dtype).view(like.shape)


def _shared(version: int, path: str, nbytes: int, entries, live: bool = False) -> SharedWeights:
    owner = owners.this_owner()
    return SharedWeights(version, path, owner["host"], owner["boot"], nbytes, tuple(entries), live)


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

