"""Files of an shm store: private (0700 folders, 0600 files) and, for metadata, checksummed.

A metadata file (meta.json, a refs file) is the xxh3 of its JSON in 16 hex digits, a space, then the
JSON: a damaged or truncated one is a CorruptChunkError, never rows read from a wrong map.
"""

from __future__ import annotations

import contextlib
import os
import re

from dataplane_rl.errors import CorruptChunkError
from dataplane_rl.store.base import checksum

CHUNK_KEY = re.compile(r"^put-[0-9a-f]{32}@[0-9]{1,15}$")  # a chunk key in a refs file: a file of chunks/ only
DIR_MODE, FILE_MODE = 0o700, 0o600  # private to the store's user


def create_file(path: str, data: bytes = b"") -> None:
    """Make a new private file holding `data` (O_EXCL: never reuses a name), or none at all: a write that
    fails (a full filesystem) removes the file, so no empty marker or metadata file is left to misread."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, FILE_MODE)
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
    fd = os.open(path, os.O_RDONLY)
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
