"""Transient Mooncake answers, retried within a deadline and counted (`dataplane_store_retries_total`).

What a loaded machine answers that a retry fixes (mooncake-store's client and master, 0.3.13):
- LEASE_EXPIRED (-707) on a read: the bytes arrived, but after the read's lease (the master's
  default_kv_lease_ttl) ran out, so the client cannot vouch for them. Our objects are write-once and only a
  drop removes them, so reading again is right (a drop then answers OBJECT_NOT_FOUND, which is not retried).
- TRANSFER_FAIL (-800): a holder did not answer in time. A killed holder answers so too, until the master
  forgets it after client_ttl (then its keys read OBJECT_NOT_FOUND): a self-started cluster is polled before
  each retry, so a dead holder is named at once; a client by URL learns it when the keys vanish.
- OBJECT_NOT_FOUND (-704) when ending a put session (put sessions are ours alone): the master discarded the
  reservation (put_start_discard_timeout_sec); nothing was published, so the put is made again. ILLEGAL_CLIENT
  (-601) says the same when the master gave the discarded key to another client's put session meanwhile
  (measured: the other's value is the one stored, whole).
Anything else is an error at once, and so is a transient answer past the deadline (store.py's `_error`
names it).
"""

from __future__ import annotations

import time
from typing import Callable

from dataplane_rl.store.mooncake.client import LEASE_EXPIRED, TRANSFER_FAIL

READ_TRANSIENT = frozenset({LEASE_EXPIRED, TRANSFER_FAIL})
# A dead holder answers TRANSFER_FAIL too, for client_ttl, to a client that cannot poll its processes:
# retry it only this long, then the caller's error names the lost block.
TRANSFER_FAIL_RETRY_S = 15.0
# Longer than the master's client_ttl (10 s by default; 60 s in a cluster the store starts) plus a
# put_start_discard_timeout_sec (30 s): a slow store makes a call slower, and a dead holder's keys turn into
# OBJECT_NOT_FOUND within it.
RETRY_DEADLINE_S = 120.0
_FIRST_DELAY_S, _MAX_DELAY_S = 0.001, 0.25


class Retries:
    """One call's retries: `again(code, what)` after each transient answer checks the cluster (`check(what)`
    raises if a process of it died) and, before the deadline, counts it (`count()`), sleeps a growing delay
    and returns True; past the deadline it returns False and the caller raises its own error, which names
    what failed."""

    def __init__(self, count: Callable[[], None], check: Callable[[str], None],
                 deadline_s: float = RETRY_DEADLINE_S, max_delay_s: float = _MAX_DELAY_S) -> None:
        self._count, self._check, self._deadline_s, self._max_delay = count, check, deadline_s, max_delay_s
        self._t0: float | None = None
        self._delay = _FIRST_DELAY_S
        self.tries = 0
        self.seen: set[int] = set()  # the transient answers retried: TRANSFER_FAIL says a holder stopped answering

    @classmethod
    def uncounted(cls, check: Callable[[str], None], deadline_s: float = RETRY_DEADLINE_S,
                  max_delay_s: float = _MAX_DELAY_S) -> "Retries":
        """Retries that count nothing: a wait that is not an error's retry, or answers a caller counted already."""
        return cls(_no_count, check, deadline_s, max_delay_s)

    def again(self, code: int, what: str) -> bool:
        now = time.monotonic()
        if self._t0 is None:
            self._t0 = now
        self._check(what)
        self.seen.add(code)
        limit = min(self._deadline_s, TRANSFER_FAIL_RETRY_S) if code == TRANSFER_FAIL else self._deadline_s
        if now - self._t0 > limit:
            return False
        self._count()
        self.tries += 1
        time.sleep(self._delay)
        self._delay = min(2 * self._delay, self._max_delay)
        return True


def _no_count() -> None:
    pass
