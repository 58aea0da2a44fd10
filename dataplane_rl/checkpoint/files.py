"""What a checkpoint folder holds on disk, read without running any code it carries, and verified byte by byte.

A checkpoint is shared and downloaded like a model, so nothing in it may run code when read:
  * `manifest.json` lists every other file with its size and xxh3 (as the store's chunks carry); it is
    written last, so a folder without one is incomplete, and it is checked before anything is loaded;
  * DCP's `.metadata` is a pickle: `SafeReader` reads it with an unpickler admitting only the classes
    DCP's metadata is made of (torch 2.13 offers no pickle-free reader for it);
  * DCP's non-tensor items (optimizer param groups, scheduler, RNG lists) are torch.save'd values that
    DCP's default planner reads with `torch.load(weights_only=False)`; `SafeLoadPlanner` reads them with
    `weights_only=True` (tensors DCP already reads that way);
  * everything else is JSON, YAML (safe_load) or Arrow IPC.
"""

from __future__ import annotations

import io
import json
import os
import pickle
from pathlib import Path

import torch
import xxhash
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner

from dataplane_rl.errors import ConfigError

MANIFEST = "manifest.json"
FORMAT = 1
_CHUNK = 1 << 20

# the classes a DCP .metadata pickle is made of (torch 2.13, FileSystemWriter): found by listing the
# globals of real checkpoints' metadata; anything else in that file is refused
_DCP_CLASSES = {
    "torch.distributed.checkpoint.metadata": {"Metadata", "TensorStorageMetadata", "TensorProperties",
                                              "ChunkStorageMetadata", "BytesStorageMetadata", "MetadataIndex",
                                              "StorageMeta", "_MEM_FORMAT_ENCODING"},
    "torch.distributed.checkpoint.filesystem": {"_StorageInfo", "_StoragePrefix"},
    "torch.serialization": {"_get_layout"},
    "torch._utils": {"_get_layout"},
    "pathlib": {"PosixPath", "PurePosixPath"},
    "collections": {"OrderedDict"},
}


class CheckpointError(ConfigError):
    """A checkpoint file is missing, damaged, or holds something other than what a checkpoint holds."""


class UnsafePickleError(pickle.UnpicklingError):
    pass


class _MetadataUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str):
        if name in _DCP_CLASSES.get(module, ()):
            return super().find_class(module, name)
        if module == "torch" and (name == "Size" or isinstance(getattr(torch, name, None), torch.dtype)):
            return getattr(torch, name)
        raise UnsafePickleError(f"{module}.{name} is not a class DCP metadata is made of")


def read_dcp_metadata(path: Path):
    """DCP's `.metadata` of the checkpoint folder `path`, through the restricted unpickler."""
    f = path / ".metadata"
    try:
        with open(f, "rb") as fh:
            return _MetadataUnpickler(fh).load()
    except (pickle.UnpicklingError, EOFError, AttributeError, TypeError, ValueError, ImportError) as e:
        raise CheckpointError(f"{f}: not a DCP metadata file ({type(e).__name__}: {e}); refused without "
                              "running it") from None


class SafeReader(FileSystemReader):
    def read_metadata(self, *args, **kwargs):
        from torch.distributed.checkpoint.metadata import StorageMeta

        metadata = read_dcp_metadata(Path(self.path))
        if getattr(metadata, "storage_meta", None) is None:  # what FileSystemReader.read_metadata does too
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata


class SafeLoadPlanner(DefaultLoadPlanner):
    """DefaultLoadPlanner with its one pickle load (non-tensor items) made weights_only."""

    def __init__(self, path: Path, **kwargs) -> None:
        super().__init__(**kwargs)
        self.path = path

    def load_bytes(self, read_item, value: io.BytesIO) -> None:
        fqn = read_item.dest_index.fqn
        try:
            obj = torch.load(value, weights_only=True)
        except Exception as e:  # noqa: BLE001 - torch raises UnpicklingError or RuntimeError for a refused global
            info = self.metadata.storage_data.get(read_item.storage_index) if self.metadata else None
            where = self.path / info.relative_path if info is not None else self.path
            lines = [x.strip() for x in str(e).splitlines() if x.strip()] or [type(e).__name__]
            why = next((x for x in lines if x.startswith("Unsupported global")), lines[0])  # torch's clue
            raise CheckpointError(f"{where}: item {fqn} is not plain data ({why}); refused without "
                                  "running it") from None
        if self.flatten_state_dict:
            from torch.distributed.checkpoint._traverse import set_element

            set_element(self.original_state_dict, self.mappings[fqn], obj)
        else:
            self.state_dict[fqn] = obj


def dcp_load(state: dict, path: Path, **kwargs) -> None:
    """`dcp.load` through the safe reader and planner."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException

    try:
        dcp.load(state, storage_reader=SafeReader(str(path)), planner=SafeLoadPlanner(path), **kwargs)
    except CheckpointException as e:  # DCP wraps every rank's error; ours is one line, passed on as it is
        ours = [exc for exc, _ in e.failures.values() if isinstance(exc, CheckpointError)]
        if ours:
            raise ours[0] from None
        raise


# -- the manifest -------------------------------------------------------------------------------------
def file_digest(path: Path) -> str:
    h = xxhash.xxh3_64()
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            h.update(chunk)
    return h.hexdigest()


def _files(folder: Path) -> list[Path]:
    return sorted(p for p in folder.rglob("*") if p.is_file() and p.name != MANIFEST)


def write_manifest(folder: Path, step: int) -> Path:
    """List every file under `folder`; written under a temporary name and renamed, last of all."""
    files = {p.relative_to(folder).as_posix(): {"bytes": p.stat().st_size, "xxh3": file_digest(p)}
             for p in _files(folder)}
    tmp = folder / f".{MANIFEST}.tmp"
    tmp.write_text(json.dumps({"format": FORMAT, "step": step, "files": files}, indent=1) + "\n")
    os.replace(tmp, folder / MANIFEST)
    return folder / MANIFEST


def read_json(path: Path) -> dict:
    try:
        value = json.loads(path.read_bytes())
    except (OSError, ValueError) as e:
        raise CheckpointError(f"{path}: not readable JSON ({type(e).__name__}: {e})") from None
    if not isinstance(value, dict):
        raise CheckpointError(f"{path}: expected a JSON object, found {type(value).__name__}")
    return value


def damage(folder: Path) -> str | None:
    """What is wrong with the checkpoint `folder` ('file F: why'), or None when every byte is as saved."""
    if not (folder / MANIFEST).is_file():
        return f"file {MANIFEST} is missing (the save did not finish)"
    try:
        files = read_json(folder / MANIFEST)["files"]
        expected = {str(k): (int(v["bytes"]), str(v["xxh3"])) for k, v in files.items()}
    except (CheckpointError, KeyError, TypeError, ValueError, AttributeError):
        return f"file {MANIFEST} is not a checkpoint manifest"
    for rel, (size, digest) in expected.items():
        p = folder / rel
        if Path(rel).is_absolute() or ".." in Path(rel).parts or p.is_symlink() or not p.is_file():
            return f"file {rel} is missing"
        got = p.stat().st_size
        if got != size:
            return f"file {rel} is {'truncated' if got < size else 'longer than saved'} ({got} of {size} bytes)"
        if file_digest(p) != digest:
            return f"file {rel} has changed bytes (xxh3 differs from the manifest)"
    for p in _files(folder):
        if p.relative_to(folder).as_posix() not in expected:
            return f"file {p.relative_to(folder).as_posix()} is not in the manifest"
    return None
