"""Every error the data plane raises. Each names the thing, the value and the fix; `one_line` is how the user
sees any error: one line, whatever crossed Ray on the way."""

import re


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


# colour codes Ray puts into a remote traceback's text
_ANSI = re.compile(r"\x1b\[[0-9;?]*[A-Za-z]")


def strip_ansi(text: str) -> str:
    return _ANSI.sub("", text)


def crossed_ray(e: BaseException) -> bool:
    """Whether `e` is one of Ray's errors (a RayTaskError, an actor's death, a cancelled task), by its classes'
    module: this module imports no Ray."""
    return any(c.__module__.startswith("ray.") for c in type(e).__mro__)


def unwrap(e: BaseException) -> BaseException:
    """The error raised inside a Ray task or actor, for a RayTaskError (its `cause`, however deep); else `e`."""
    for _ in range(16):  # a task that called a task that failed: a RayTaskError whose cause is another
        cause = getattr(e, "cause", None)
        if not (crossed_ray(e) and isinstance(cause, BaseException)):
            break
        e = cause
    return e


def one_line(e: BaseException) -> str:
    """`Name: first line of the message`: no Ray wrapper text (`RayTaskError(X)`), no colour codes, no remote
    traceback (a RayTaskError's text carries it; the run's error.log keeps it)."""
    shown = unwrap(e)
    lines = [x.strip() for x in strip_ansi(str(shown)).splitlines() if x.strip()]
    if not lines:  # no message (Ray's TaskCancelledError): what the class says of itself
        lines = [x.strip() for x in (type(shown).__doc__ or "").splitlines() if x.strip()] or ["(no message)"]
    return f"{type(shown).__name__}: {lines[0]}"
