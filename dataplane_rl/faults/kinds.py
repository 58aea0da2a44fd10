"""The errors and text every fault handler shares (the kinds of fault are the ledger's: run/ledger.py FaultKind)."""

from __future__ import annotations

from dataplane_rl.errors import DataPlaneError


class RolloutActorError(DataPlaneError, RuntimeError):
    """A rollout actor died; the rows it owed never arrive."""


def first_line(e: BaseException | str) -> str:
    """An error's (or a text's) first line; an error without text: its type's name."""
    text = str(e).strip()
    return text.splitlines()[0] if text else type(e).__name__
