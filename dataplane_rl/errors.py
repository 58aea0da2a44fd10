"""Every error the data plane raises. Each names the thing, the value and the fix."""


class DataPlaneError(Exception):
    """Base of every dataplane-rl error."""


class ConfigError(DataPlaneError, ValueError):
    """A config file, key or value is invalid."""


class SchemaError(DataPlaneError, ValueError):
    """A schema file is invalid, or data does not match the declared schema."""


class AlignmentError(DataPlaneError, ValueError):
    """Columns of one put do not cover the same rows."""


class MissingColumnError(DataPlaneError, KeyError):
    """A read asked for cells that have not been written."""

    def __str__(self) -> str:  # KeyError would repr() the message
        return str(self.args[0]) if self.args else ""


class DuplicateWriteError(DataPlaneError, ValueError):
    """A put would write a cell that is already written."""


class PartitionNotFoundError(DataPlaneError, KeyError):
    """The partition does not exist or was dropped."""

    def __str__(self) -> str:
        return str(self.args[0]) if self.args else ""


class PartitionExistsError(DataPlaneError, ValueError):
    """create_partition with an id that already exists."""


class StoreUnavailableError(DataPlaneError, RuntimeError):
    """The backend is down, unreachable, or lost data it held."""


class CorruptChunkError(StoreUnavailableError):
    """A stored chunk or its metadata failed its checksum: it was corrupted or evicted."""


class StoreFullError(StoreUnavailableError):
    """The store has no room for a write; nothing of that write was kept."""


class StoreTimeoutError(DataPlaneError, TimeoutError):
    """store.wait gave up: the named rows were not all written within the timeout."""


class RewardFunctionError(DataPlaneError, ValueError):
    """The user's reward function (task.reward_function) raised, or returned NaN, an infinity or a non-number: a
    failure of the data, never stored as a reward."""


def format_rows(rows) -> str:
    """Compact row description for error messages: '0-255', '3,7,9', '0-9,12 (11 rows)'."""
    rows = sorted(int(r) for r in rows)
    if not rows:
        return "none"
    spans, start, prev = [], rows[0], rows[0]
    for r in rows[1:]:
        if r == prev + 1:
            prev = r
            continue
        spans.append((start, prev))
        start = prev = r
    spans.append((start, prev))
    text = ",".join(f"{a}-{b}" if a != b else f"{a}" for a, b in spans[:6])
    if len(spans) > 6:
        text += ",..."
    return text if len(spans) == 1 else f"{text} ({len(rows)} rows)"
