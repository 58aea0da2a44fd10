"""The run's timeline (docs/trace.md): spans of every process as Chrome trace events, and RUN_DIR/trace.json.

Each process has one `Tracer` (this module's `TRACER`, off until `configure`). `span(name)` (or the
decorator `traced(name)`) records a complete event (`ph: "X"`) in a bounded in-memory buffer; actors hand
their buffer to the driver with results they already return (`take`), the driver names them by role
(`absorb`) and `TraceFile` appends everything to trace.json once a step. Timestamps are microseconds of
wall time since the epoch, read off perf_counter aligned to it once per process (to within the closest of a few
paired reads), so every process of a run shares one clock (on one machine to microseconds, unless the wall clock
is stepped between two processes' starts; across machines as far as their clocks agree).

The file is the JSON object format, one event a line, its closing tail rewritten after every write: it
parses whole after each step, and `read_trace` also reads a file a kill cut short mid-write.
"""

from __future__ import annotations

import contextlib
import functools
import json
import os
import socket
import time
from pathlib import Path

# what the bound drops: events past the buffer's cap (per process, between two takes) or the file's cap,
# counted; process names and labels (metadata) are always kept
BUFFER_EVENTS = 50_000


def _wall_offset_ns(tries: int = 7) -> int:
    """perf_counter -> wall clock, fixed once per process: the wall clock read between two perf_counter reads,
    from the try whose two reads lie closest. One try errs by however long the process was preempted between its
    reads: on a busy machine a rollout actor's events once began 4.3 ms before the driver had sent its job."""
    best = None
    for _ in range(tries):
        a = time.perf_counter_ns()
        wall = time.time_ns()
        b = time.perf_counter_ns()
        if best is None or b - a < best[0]:
            best = (b - a, wall - (a + b) // 2)
    return best[1]


_OFFSET_NS = _wall_offset_ns()


def now_us(perf_s: float | None = None) -> int:
    """Wall-clock microseconds since the epoch, of now or of a `time.perf_counter()` reading."""
    ns = time.perf_counter_ns() if perf_s is None else int(perf_s * 1e9)
    return (ns + _OFFSET_NS) // 1000


def role_pid(role: str, taken: int = 0) -> int:
    """A process's pid in the file, fixed by its role whatever the run's shape (a resumed run with fewer
    actors appends to the same file): driver 1, rollout-I 10001+I, train-rank-R 20001+R; viewers sort by
    it. Another role: 30001 + `taken` (the roles seen before it)."""
    kind, _, num = role.rpartition("-")
    if role == "driver" or kind not in ("rollout", "train-rank") or not num.isdigit() or int(num) >= 10_000:
        return 1 if role == "driver" else 30_001 + taken
    return (10_001 if kind == "rollout" else 20_001) + int(num)


def actor_roles(rollout: int, ranks: int) -> list[str]:
    """The actors' names in the file: rollout-0.., then train-rank-0.."""
    return [f"rollout-{i}" for i in range(rollout)] + [f"train-rank-{r}" for r in range(ranks)]


class Tracer:
    """One process's spans. Off (the default), `span` records nothing and costs one branch."""

    def __init__(self) -> None:
        self.enabled = False
        self.events: list[dict] = []
        self.dropped = 0  # events the buffer's cap dropped since the process started
        self.cap = BUFFER_EVENTS
        self.pids: dict[str, int] = {}  # the driver's: role -> pid in the file (role_pid)
        self.role: str | None = None  # "driver" in the driver; actors are named by the driver
        self._labelled = False

    def configure(self, enabled: bool, role: str | None = None, roles: tuple = (), cap: int = BUFFER_EVENTS) -> None:
        """Turn tracing on or off. The driver passes its role and every process's role (named in the file
        even if it records nothing); an actor passes only `enabled`."""
        self.enabled, self.role, self.cap = enabled, role, cap
        self.events, self.dropped, self._labelled, self.pids = [], 0, False, {}
        for r in ([role] if role else []) + [r for r in roles if r != role]:
            self._pid(r)

    def _pid(self, role: str) -> int:
        """The role's pid; a role seen first names its process (metadata events, never dropped)."""
        pid = self.pids.get(role)
        if pid is None:
            pid = self.pids[role] = role_pid(role, len(self.pids))
            self.events += [{"name": "process_name", "ph": "M", "pid": pid, "tid": 0, "args": {"name": role}},
                            {"name": "process_sort_index", "ph": "M", "pid": pid, "tid": 0, "args": {"sort_index": pid}}]
        return pid

    def _add(self, event: dict) -> None:
        if len(self.events) >= self.cap:
            self.dropped += 1
            return
        if self.role:
            event["pid"] = self._pid(self.role)
        self.events.append(event)

    @contextlib.contextmanager
    def span(self, name: str, **args):
        """Record `name` from entry to exit; yields its args dict, which the block may fill in (bytes...)."""
        if not self.enabled:
            yield args
            return
        start = time.perf_counter_ns()
        try:
            yield args
        finally:
            end = time.perf_counter_ns()
            ts = (start + _OFFSET_NS) // 1000
            self._add({"name": name, "ph": "X", "ts": ts, "dur": (end + _OFFSET_NS) // 1000 - ts, "tid": 1,
                       "args": args})

    def complete(self, name: str, start_perf_s: float, **args) -> None:
        """A span measured by the caller: from its `time.perf_counter()` reading `start_perf_s` to now."""
        if self.enabled:
            ts = now_us(start_perf_s)
            self._add({"name": name, "ph": "X", "ts": ts, "dur": now_us() - ts, "tid": 1, "args": args})

    def take(self) -> list[dict]:
        """The events since the last take (the buffer empties). An actor's first take starts with a label
        (host and OS pid); a take after drops ends with a counter event of the drops so far."""
        if not self.enabled:
            return []
        out, self.events = self.events, []
        if not self._labelled:
            self._labelled = True
            label = {"name": "process_labels", "ph": "M", "tid": 0,
                     "args": {"labels": f"{socket.gethostname()} pid {os.getpid()}"}}
            if self.role:
                label["pid"] = self._pid(self.role)
            out.insert(0, label)
        if self.dropped:
            out.append({"name": "trace_dropped_events", "ph": "C", "ts": now_us(), "tid": 1,
                        "args": {"events": self.dropped}, **({"pid": self._pid(self.role)} if self.role else {})})
        return out

    def absorb(self, events: list[dict] | None, role: str) -> None:
        """The driver: an actor's taken events, now of the process named `role`."""
        if not self.enabled or not events:
            return
        pid = self._pid(role)
        for e in events:
            e["pid"] = pid
            if e["ph"] == "M":
                self.events.append(e)
            elif len(self.events) < self.cap:
                self.events.append(e)
            else:
                self.dropped += 1


TRACER = Tracer()
span = TRACER.span
complete = TRACER.complete
take = TRACER.take
absorb = TRACER.absorb
configure = TRACER.configure


def traced(name: str):
    """Decorator: every call of the function is a span `name`."""
    def wrap(fn):
        @functools.wraps(fn)
        def inner(*a, **kw):
            if not TRACER.enabled:
                return fn(*a, **kw)
            with TRACER.span(name):
                return fn(*a, **kw)
        return inner
    return wrap


_HEAD = '{"traceEvents": [\n'


class TraceFile:
    """RUN_DIR/trace.json, appended once a step: the first `max_events` timed events are kept, later ones
    counted (`otherData.dropped_events`); metadata always goes in. `resume` keeps the events already there."""

    def __init__(self, path: str | Path, max_events: int, resume: bool = False) -> None:
        self.path, self.max_events = Path(path), max_events
        self.written = self.dropped = 0
        kept = read_trace(self.path)["traceEvents"] if resume and self.path.is_file() else []
        self.f = open(self.path, "w")
        self.f.write(_HEAD)
        self.end = self.f.tell()  # where the tail starts: the next event overwrites it
        self.first = True
        self.write(kept)

    def write(self, events: list[dict]) -> None:
        """Append the events and rewrite the tail: the file parses whole after every call."""
        lines = []
        for e in events:
            if e.get("ph") != "M":
                if self.written >= self.max_events:
                    self.dropped += 1
                    continue
                self.written += 1
            lines.append(("" if self.first else ",\n") + json.dumps(e, separators=(",", ":")))
            self.first = False
        self.f.seek(self.end)
        self.f.write("".join(lines))
        self.end = self.f.tell()
        other = {"max_events": self.max_events, "timed_events": self.written, "dropped_events": self.dropped}
        self.f.write('\n],\n"displayTimeUnit": "ms",\n"otherData": ' + json.dumps(other) + "}\n")
        self.f.truncate()
        self.f.flush()

    def close(self, events: list[dict] = ()) -> None:
        if self.f.closed:
            return
        try:
            self.write(list(events))
        finally:  # a full disk: the file as last written, closed all the same
            with contextlib.suppress(OSError):
                self.f.close()


def read_trace(path: str | Path) -> dict:
    """A trace.json as {"traceEvents": [...], ...}; a file cut short (a kill mid-write) gives its complete
    events, every event on a line of its own up to the first broken one."""
    text = Path(path).read_text()
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        pass
    events = []
    for line in text.splitlines()[1:]:
        line = line.strip().removesuffix(",")
        if not line.startswith("{"):
            break
        try:
            events.append(json.loads(line))
        except json.JSONDecodeError:
            break
    return {"traceEvents": events}
