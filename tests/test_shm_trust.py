"""An shm store trusts only its owner (docs/security.md): a store folder another user owns, that others may write,
or that is a symlink is refused, and so is a symlink where the store expects one of its files or folders.
Each refusal is one StoreUnavailableError line naming the path and its owner, and nothing is written."""

from __future__ import annotations

import os
import shutil
import uuid

import pytest

from dataplane_rl.errors import StoreUnavailableError
from dataplane_rl.store import open_store
from store_workers import grpo_columns
from test_shm_faults import NOBODY, need_root


@pytest.fixture
def folder():
    """A store folder of this user in /dev/shm holding partition p (8 rows, two columns written)."""
    path = f"/dev/shm/dataplane-rl-test-trust-{uuid.uuid4().hex[:8]}"
    s = open_store(f"shm://{path}")
    s.create_partition("p", "grpo", 8)
    s.put("p", grpo_columns(range(8), ["input_lengths", "total_reward"]), range(8))
    s.close()
    yield path
    shutil.rmtree(path, ignore_errors=True)


def listing(path: str) -> list[str]:
    return sorted(os.path.relpath(os.path.join(d, n), path) for d, ds, fs in os.walk(path) for n in ds + fs)


def use(url: str) -> None:
    """Open the store and touch every kind of file in it: marker, pool, partition folder, meta, refs, lock,
    readers and a chunk file."""
    s = open_store(url)
    try:
        s.status("p")
        s.get("p", ["total_reward"])
        s.put("p", grpo_columns(range(8), ["group_id"]), range(8))
        s.create_partition("q", "grpo", 1)
    finally:
        s.close()


def test_folder_of_another_user_refused(folder):
    """The probe's case: `nobody` made the folder, world-writable, with a valid marker; root must not write."""
    need_root("chown to nobody")
    for d, ds, fs in os.walk(folder):
        for n in [d, *(os.path.join(d, x) for x in ds + fs)]:
            os.chown(n, NOBODY, NOBODY)
    os.chmod(folder, 0o777)
    before = listing(folder)
    with pytest.raises(StoreUnavailableError, match=rf"^shm store {folder} belongs to another user; owner nobody"):
        use(f"shm://{folder}")
    os.chmod(folder, 0o700)  # private, still not ours
    with pytest.raises(StoreUnavailableError, match="belongs to another user; owner nobody"):
        use(f"shm://{folder}")
    assert listing(folder) == before


@pytest.mark.parametrize("mode", [0o770, 0o707, 0o720])
def test_group_or_world_writable_folder_refused(folder, mode):
    os.chmod(folder, mode)
    before = listing(folder)
    with pytest.raises(StoreUnavailableError, match=rf"{folder} is group- or world-writable \(mode {mode:o}\); owner"):
        use(f"shm://{folder}")
    assert listing(folder) == before


@pytest.mark.parametrize("existing", [True, False], ids=["to-a-store", "to-an-empty-folder"])
def test_symlink_at_the_store_path_refused(folder, tmp_path, existing):
    target = folder if existing else str(tmp_path / "empty")
    os.makedirs(target, mode=0o700, exist_ok=True)
    link = str(tmp_path / "link")
    os.symlink(target, link)
    before = listing(target)
    with pytest.raises(StoreUnavailableError, match=rf"shm store {link} is a symlink .*not a folder; owner"):
        use(f"shm://{link}")
    assert listing(target) == before  # nothing built in the link's target


@pytest.mark.parametrize("inside", [".dataplane-rl", ".pool", "p", "p/chunks", "p/log", "p/readers",
                                    "chunk"])
def test_symlink_inside_the_store_refused(folder, tmp_path, inside):
    """Each file or folder replaced by a symlink to an identical copy: only the symlink can be refused."""
    if inside == "chunk":
        inside = os.path.relpath(next(os.scandir(f"{folder}/p/chunks")).path, folder)
    path = os.path.join(folder, inside)
    copy = str(tmp_path / "copy")
    (shutil.copytree if os.path.isdir(path) else shutil.copy2)(path, copy)
    (shutil.rmtree if os.path.isdir(path) else os.unlink)(path)
    os.symlink(copy, path)
    with pytest.raises(StoreUnavailableError, match=rf"shm store {path} is a symlink .*; owner"):
        use(f"shm://{folder}")
