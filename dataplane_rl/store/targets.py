"""Where a command may write a file: never inside a column store's folder, never over what is not the user's own.

`dataplane-rl store export URL P OUT` once returned 0 with OUT inside the store it read (DIR/step-000002/log,
or one of the partition's own segments): the rename that makes the write atomic put a Parquet file where the
store's log was. So every command that writes a file asks `check_target` first, and writes through a temporary
file it renames (`write_parquet`, `export_hf`); `writing` turns the OSError of a target the checks cannot see
coming (`/proc`, a read-only mount, a full disk) into one line naming the file.
"""

from __future__ import annotations

import contextlib
import os
import stat
from pathlib import Path
from typing import Iterator

from dataplane_rl.errors import ConfigError
from dataplane_rl.store.shm.owners import MARKER


def store_folder_of(path: Path) -> Path | None:
    """The store folder (one holding the store's marker file) that `path` is, or lies inside, if any."""
    for folder in (path, *path.parents):
        if os.path.lexists(folder / MARKER):
            return folder
    return None


def check_target(out: str | os.PathLike, what: str, *, folder: bool = False) -> Path:
    """`out`, checked as the place `what` (an option's name, e.g. 'store export OUT') will write a new file
    (or, with `folder`, a new folder): a ConfigError naming it and the fix if it lies in a store's folder,
    is the wrong kind, has no parent folder, or is another user's. Returns the path, its symlinks resolved."""
    given = Path(out)
    # symlinks resolved: a link to a store's file is the store's file
    path = Path(os.path.realpath(given))
    inside = store_folder_of(path)
    if inside is not None:
        raise ConfigError(f"{what} {given} is inside the column store folder {inside}: writing there would damage "
                          "the store; write it outside any store folder")
    parent = path.parent
    if not parent.is_dir():
        raise ConfigError(f"{what} {given}: its folder {parent} does not exist; create it first or choose another")
    with contextlib.suppress(FileNotFoundError):
        st = os.stat(path)
        if os.path.isdir(path) and not folder:
            raise ConfigError(f"{what} {given} is a folder; name a file, e.g. {given / 'out.parquet'}")
        if not (stat.S_ISREG(st.st_mode) or stat.S_ISDIR(st.st_mode)):
            # the rename would replace a device or a pipe (as root, /dev/full became a Parquet file)
            raise ConfigError(f"{what} {given} is not a regular file (a device, pipe or socket); name a new file")
        if st.st_uid != os.geteuid():
            raise ConfigError(f"{what} {given} belongs to another user (uid {st.st_uid}); choose a path of your own")
    if not os.access(parent, os.W_OK | os.X_OK):
        raise ConfigError(f"{what} {given}: its folder {parent} is not writable; choose another")
    return path


@contextlib.contextmanager
def writing(path: str | os.PathLike, what: str) -> Iterator[None]:
    """An OSError while writing `path` (a pseudo filesystem like /proc, a read-only mount, a full disk) as
    one ConfigError naming the file and the cause."""
    try:
        yield
    except OSError as e:
        cause = e.strerror or str(e)
        raise ConfigError(f"{what} {path} could not be written: {cause}; choose another place (nothing was "
                          "written there)") from None
