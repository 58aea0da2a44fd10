"""An shm log file: a header saying how far it is committed, then framed records (catalog.py, commit.py).

    header   magic, the committed end, the xxh3 of the end (HEAD_BYTES in all)
    records  each its framed JSON's length, then the framed JSON (files.framed: xxh3, then the text)

A partition has one such file for its meta (DIR/<pid>/log, record 0 only) and one per writer process for
its puts (DIR/<pid>/logs/<n>). Only its own writer appends to a writer's log: it writes the record past the
end, then moves the end in the header (one small write of a page that exists), so a reader only ever sees
whole records, and bytes past the end of a writer that died are never read.
"""

from __future__ import annotations

import json
import os
import struct

from dataplane_rl.errors import CorruptChunkError
from dataplane_rl.store.chunks import PartitionMeta, checksum
from dataplane_rl.store.shm.files import framed, unframe

_HEAD = struct.Struct("<8sQQ")  # magic, committed end, xxh3 of the end's 8 bytes
_MAGIC = b"dprl-log"
HEAD_BYTES = 64  # the first record starts here
_LEN = struct.Struct("<I")  # a record: its framed JSON's length, then the framed JSON


def _end_check(end: int) -> int:
    return checksum(end.to_bytes(8, "little"))


def _head(end: int) -> bytes:
    return _HEAD.pack(_MAGIC, end, _end_check(end))


def empty_log() -> bytes:
    """A writer's log before its first commit: a header whose end is the first record's place."""
    return _head(HEAD_BYTES).ljust(HEAD_BYTES, b"\0")


def _record(text: str) -> bytes:
    body = framed(text)
    return _LEN.pack(len(body)) + body


def meta_text(meta: PartitionMeta) -> str:
    """The meta log's record: a line of JSON (pid, num_rows), then the schema JSON verbatim, so a reader
    parses only the small line and decodes the schema once per process (schema_of caches by its text)."""
    return json.dumps({"pid": meta.pid, "num_rows": meta.num_rows}) + "\n" + meta.schema_json


def parse_meta(text: str, token: str) -> PartitionMeta:
    head, _, schema_json = text.partition("\n")
    d = json.loads(head)
    if not schema_json.startswith("{"):
        raise ValueError("no schema after the first line")
    return PartitionMeta(d["pid"], schema_json, int(d["num_rows"]), token)


class Tail:
    """One log file as this process follows it: its descriptor and how far this process has read."""

    def __init__(self, fd: int, path: str) -> None:
        self.fd, self.path, self.end = fd, path, HEAD_BYTES

    def committed(self) -> int:
        """The committed end, from the header. A header read while its writer rewrites it may mix the two
        (its checksum says so): read again."""
        for _ in range(100):
            magic, end, check = _HEAD.unpack(os.pread(self.fd, _HEAD.size, 0).ljust(_HEAD.size, b"\0"))
            if magic == _MAGIC and check == _end_check(end):
                return end
            if magic != _MAGIC:
                break
        raise CorruptChunkError(f"shm metadata {self.path} is damaged (no valid header); the partition cannot be "
                                "trusted, drop it and regenerate the step")

    def records(self, end: int) -> list[str]:
        """The JSON of each record from what this process has read up to `end`."""
        data = os.pread(self.fd, end - self.end, self.end) if end > self.end else b""
        if len(data) != end - self.end:
            raise CorruptChunkError(f"shm metadata {self.path} is damaged ({self.end + len(data)} bytes, the header "
                                    f"says {end}); the partition cannot be trusted, drop it and regenerate the step")
        out, at = [], 0
        while at < len(data):
            n = _LEN.unpack_from(data, at)[0] if at + _LEN.size <= len(data) else -1
            body = data[at + _LEN.size:at + _LEN.size + n] if n >= 0 else b""
            body = body if len(body) == n else b""  # a cut record reads as empty: unframe names the log as damaged
            try:
                out.append(unframe(body, self.path))
            except CorruptChunkError:  # again, to name the record's place (not formatted for every good record)
                unframe(body, f"{self.path} at {self.end + at}")
                raise
            at += _LEN.size + n
        return out

    def append(self, text: str) -> int:
        """Commit a record (this process is the log's only writer): the record past the end, where no reader
        looks, then the end moved in the header. Returns the new end; the caller sets `self.end` to it."""
        record = _record(text)
        end = self.end + len(record)
        if os.pwrite(self.fd, record, self.end) != len(record):
            raise OSError(28, "short write", self.path)  # ENOSPC: the store's full error
        os.pwrite(self.fd, _head(end), 0)  # the commit
        return end

    def close(self) -> None:
        if self.fd >= 0:
            fd, self.fd = self.fd, -1
            os.close(fd)
