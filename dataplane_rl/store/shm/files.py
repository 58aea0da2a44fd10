"""A store's own files (shm folders, ownership records): private (0700 folders, 0600 files), trusted only if
they are the user's own, and, for metadata, checksummed.

A metadata file (meta.json, a refs file) is the xxh3 of its JSON in 16 hex digits, a space, then the
JSON: a damaged or truncated one is a CorruptChunkError, never rows read from a wrong map.

Trust (docs/security.md): a store folder another user owns, that others may write, or that is a symlink could be
changed under us (another user renaming our partitions, or a store built in a symlink's target), so it is
refused, as is a symlink where the store expects one of its files or folders: every file is opened with
O_NOFOLLOW, every folder checked with lstat.
"""

from __future__ import annotations

import contextlib
import errno
import os
import pwd
import re
import stat

from dataplane_rl.errors import CorruptChunkError, StoreUnavailableError
from dataplane_rl.store.chunks import checksum

CHUNK_KEY = re.compile(r"put-[0-9a-f]{32}@[0-9]{1,15}")  # fullmatch only: a chunk key in a refs file: a file of chunks/ only
DIR_MODE, FILE_MODE = 0o700, 0o600  # private to the store's user


def owner_name(uid: int) -> str:
    try:
        return f"{pwd.getpwuid(uid).pw_name} (uid {uid})"
    except KeyError:
        return f"uid {uid}"


def untrusted(path: str, st: os.stat_result | None, folder: bool) -> str | None:
    """Why `path` (lstat'd as `st`) must not be used as one of the store's own files or folders, or None."""
    if st is None:
        return None
    kind = "folder" if folder else "file"
    if stat.S_ISLNK(st.st_mode):
        why = f"is a symlink (to {os.readlink(path)!r}), not a {kind}"
    elif stat.S_ISDIR(st.st_mode) != folder:
        why = f"is not a {kind}"
    elif st.st_uid != os.getuid():
        why = "belongs to another user"
    elif st.st_mode & 0o022:
        why = f"is group- or world-writable (mode {stat.S_IMODE(st.st_mode):o})"
    else:
        return None
    return (f"shm store {path} {why}; owner {owner_name(st.st_uid)}. A store is trusted only if it is a private "
            f"{kind} of this user ({owner_name(os.getuid())}): remove it or use another path")


def check_trusted(path: str, folder: bool = True) -> bool:
    """Refuse `path` unless it is absent or trusted (see `untrusted`); returns whether it exists."""
    try:
        st = os.lstat(path)
    except (FileNotFoundError, NotADirectoryError):
        return False
    why = untrusted(path, st, folder)
    if why:
        raise StoreUnavailableError(why)
    return True


def open_file(path: str, flags: int, mode: int = FILE_MODE, *, folder: str | None = None, dir_fd: int | None = None) -> int:
    """os.open that never follows a symlink: one planted where a store file belongs is refused by name.
    With `dir_fd`, `path` is a name in the open folder `dir_fd`, whose path is `folder`."""
    try:
        return os.open(path, flags | os.O_NOFOLLOW, mode, dir_fd=dir_fd)
    except OSError as e:
        if e.errno != errno.ELOOP:
            raise
        check_trusted(os.path.join(folder, path) if folder else path, folder=False)
        raise


def create_file(path: str, data: bytes = b"") -> None:
    """Make a new private file holding `data` (O_EXCL: never reuses a name), or none at all: a write that
    fails (a full filesystem) removes the file, so no empty marker or metadata file is left to misread."""
    fd = open_file(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL)
    try:
        view = memoryview(data)
        while view:
            view = view[os.write(fd, view):]
    except BaseException:
        os.close(fd)
        with contextlib.suppress(OSError):
            os.unlink(path)
        raise
    os.close(fd)


def read_file(path: str) -> bytes:
    """A metadata file's bytes. With os.open, not open(): its io layers cost more than the read, and most
    reads of a refs file find none (no new commit)."""
    fd = open_file(path, os.O_RDONLY)
    try:
        data = b""
        while chunk := os.read(fd, 1 << 20):
            data += chunk
        return data
    finally:
        os.close(fd)


def framed(text: str) -> bytes:
    """Metadata as written: the xxh3 of the JSON (16 hex digits), a space, the JSON."""
    body = text.encode()
    return b"%016x " % checksum(body) + body


def unframe(data: bytes, path: str) -> str:
    """The JSON of a metadata file, or CorruptChunkError if it is not exactly what was written."""
    head, body = data[:16], data[17:]
    try:
        ok = len(data) > 17 and data[16:17] == b" " and int(head, 16) == checksum(body)
    except ValueError:
        ok = False
    if not ok:
        raise CorruptChunkError(f"shm metadata {path} is damaged ({len(data)} bytes, checksum mismatch); the "
                                "partition cannot be trusted, drop it and regenerate the step")
    return body.decode()


class OSErrorsAs:
    """`with OSErrorsAs(convert, what, arg, need):` an OSError in the block goes to `convert(e, "what arg", need)`
    (just `what` without `arg`), which raises the caller's own error for it or returns (then the OSError goes
    on). A class, not a generator context manager: a put enters several, and a generator's set-up costs µs."""

    __slots__ = ("convert", "what", "arg", "need")

    def __init__(self, convert, what: str, arg: str = "", need: int = 0) -> None:
        self.convert, self.what, self.arg, self.need = convert, what, arg, need

    def __enter__(self) -> None:
        return None

    def __exit__(self, kind, e, tb) -> bool:
        if kind is not None and issubclass(kind, OSError):
            self.convert(e, f"{self.what} {self.arg}" if self.arg else self.what, self.need)
        return False
