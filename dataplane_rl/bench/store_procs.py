"""`bench store`'s processes: N writers and M readers started once, released together round after round."""

from __future__ import annotations

import multiprocessing as mp
import sys
import threading
import time
from typing import Any, Callable

from dataplane_rl.bench.store_work import memory

SLACK = 24 * 2**20  # private memory a reader may grow by beyond its copies of its shard
BARRIER_S = 300  # a worker waits this long at most for its peers (a dead peer breaks the barrier sooner)


class WorkerFailed(RuntimeError):
    """A benchmark worker failed: one line naming the worker (backend and role) and its error."""


def one_line(error: BaseException) -> str:
    text = str(error).strip().splitlines()
    return f"{type(error).__name__}: {text[0]}" if text else type(error).__name__


def serve(conn, barrier, setup: Callable[[], tuple[Callable, Callable]], profile: str = "") -> None:
    """A worker's life: `setup()` gives (handle, close); each message but None is handled after the other
    workers of the role reach the barrier (except ("rows", ...) asks, served alone) and answered with
    handle's dict; None ends it with ("bye", its memory with the peak). With `profile`, the
    handled calls run under cProfile, dumped there at the end. An error ends the worker with exit code 1
    after it sends ("failed", the error in one line) and breaks the barrier, so its peers stop too."""
    try:
        _serve(conn, barrier, setup, profile)
    except Exception as e:  # the parent prints it as one line naming this worker: no traceback
        failed = ("failed", one_line(e) if not isinstance(e, threading.BrokenBarrierError)
                  else "stopped: a peer failed (BrokenBarrierError)")
        try:
            barrier.abort()
            conn.send(failed)
        except Exception:
            pass
        sys.exit(1)


def _serve(conn, barrier, setup: Callable[[], tuple[Callable, Callable]], profile: str) -> None:
    handle, close = setup()
    prof = None
    if profile:
        import cProfile

        # the worker thread's CPU time, not wall time: with more workers than cores, time another process
        # took from this one would otherwise land in whatever call it was in (a cheap one looked slow)
        prof = cProfile.Profile(time.thread_time)
    conn.send(("ready", memory()))
    while (msg := conn.recv()) is not None:
        if msg[0] != "rows":
            barrier.wait(BARRIER_S)
        if prof:
            prof.enable()
        out = handle(msg)
        if prof:
            prof.disable()
        conn.send(out)
    close()
    if prof:
        prof.dump_stats(profile)
    conn.send(("bye", memory()))


def recv(conn, procs, timeout: float = 300, who: str = "a benchmark worker"):
    """The next message from worker `who`; WorkerFailed, in one line, if it failed, if none comes in
    `timeout` s or if a worker died without a word."""
    deadline = time.monotonic() + timeout
    while not conn.poll(0.2):
        dead = [p for p in procs if not p.is_alive()]
        if dead and not conn.poll(0):
            raise WorkerFailed(f"{dead[0].name} exited with code {dead[0].exitcode}"
                               f"{' (killed)' if (dead[0].exitcode or 0) < 0 else ''}")
        if time.monotonic() > deadline:
            raise WorkerFailed(f"{who}: no answer in {timeout:g} s")
    try:
        msg = conn.recv()
    except (EOFError, OSError):
        raise WorkerFailed(f"{who} closed its pipe without an answer") from None
    if isinstance(msg, tuple) and msg and msg[0] == "failed":
        raise WorkerFailed(f"{who}: {msg[1]}")
    return msg


class Pool:
    """`writers` and `readers` worker processes (spawned; a Mooncake client must not be forked), each
    running `serve` around target(*args). Every process's exit status and memory comes back from close()."""

    def __init__(self, label: str, writer: Callable, writer_args: list[tuple], reader: Callable,
                 reader_args: list[tuple], private: bool = False):
        ctx = mp.get_context("spawn")
        self.label, self.procs, self.conns, self.roles, self.barriers = label, [], [], [], []
        self.private = private  # readers get their shard into private memory (Mooncake), not a mapping
        for role, target, arglist in (("writer", writer, writer_args), ("reader", reader, reader_args)):
            barrier = ctx.Barrier(len(arglist))
            self.barriers.append(barrier)  # kept: a barrier collected before its processes start is gone
            for i, args in enumerate(arglist):
                parent, child = ctx.Pipe()
                self.procs.append(ctx.Process(target=target, args=(child, barrier, *args), daemon=True,
                                              name=f"{label} {role} {i}"))
                self.conns.append(parent)
                self.roles.append(f"{role} {i}")
        self.writers = [c for c, r in zip(self.conns, self.roles) if r.startswith("writer")]
        self.readers = [c for c, r in zip(self.conns, self.roles) if r.startswith("reader")]
        self.start_mem: list[dict] = []
        self.held = [0] * len(self.procs)  # the most bytes each process handled in one round
        self.peak_anon = [0] * len(self.procs)  # its largest anon memory at the end of a round
        self.round_rss = [0] * len(self.procs)  # its largest rss at the end of a round (a reader: holding its shard)
        for p in self.procs:
            p.start()

    def ready(self) -> None:
        for c, role in zip(self.conns, self.roles):
            msg = recv(c, self.procs, 120, f"{self.label} {role}")
            if msg[0] != "ready":
                raise RuntimeError(f"{self.label}: a benchmark worker failed to start")
            self.start_mem.append(msg[1])

    def ask_all(self, conns, msg, track: bool = True) -> list[dict]:
        """Send msg to each of conns and gather their answers; with `track`, note what each one held."""
        for c in conns:
            c.send(msg)
        try:
            out = [recv(c, self.procs, who=f"{self.label} {self.roles[self.conns.index(c)]}") for c in conns]
        except WorkerFailed as e:
            raise self._first_failure(e) from None
        for c, o in zip(conns, out if track else []):
            i = self.conns.index(c)
            self.held[i] = max(self.held[i], o.get("bytes", 0))
            self.peak_anon[i] = max(self.peak_anon[i], o.get("mem", {}).get("anon", 0))
            self.round_rss[i] = max(self.round_rss[i], o.get("mem", {}).get("rss", 0))
        return out

    def _first_failure(self, seen: WorkerFailed) -> WorkerFailed:
        """The failure that broke the barrier, rather than a peer's that stopped on it (`seen`, if it is one)."""
        if "a peer failed" not in str(seen):
            return seen
        for c, role in zip(self.conns, self.roles):
            try:
                msg = c.recv() if c.poll(1) else None
            except (EOFError, OSError):
                continue
            if isinstance(msg, tuple) and msg[0] == "failed" and "a peer failed" not in msg[1]:
                return WorkerFailed(f"{self.label} {role}: {msg[1]}")
        return seen

    def ask(self, i: int, msg) -> dict:
        """Reader i alone (no barrier): a ("rows", ...) request of the small calls, whose memory is not a round's."""
        return self.ask_all([self.readers[i]], msg, track=False)[0]

    def abort(self) -> None:
        """Stop every worker after an error, which stays the one raised (the others are not printed)."""
        try:
            self.close()
        except RuntimeError:
            pass

    def close(self) -> list[dict[str, Any]]:
        """Stop every worker; each one's role, exit status and memory (MB). Raises if one did not exit 0."""
        ends, failed = [], []
        for c in self.conns:
            try:
                c.send(None)
            except OSError:
                pass
        for c in self.conns:  # each its own: a worker that said bye may be gone while the next closes its store
            try:
                msg = c.recv() if c.poll(60) else ("late",)
                while not isinstance(msg, tuple) and c.poll(5):  # an answer not read before an error
                    msg = c.recv()
                msg = msg if isinstance(msg, tuple) else ("late",)
                ends.append(msg[1] if msg[0] == "bye" else {})
                if msg[0] == "failed" and "BrokenBarrierError" not in msg[1]:
                    failed.append(f"{self.label} {self.roles[len(ends) - 1]}: {msg[1]}")
            except (EOFError, OSError):  # died without its bye: its exit status says how
                ends.append({})
        for p in self.procs:
            p.join(timeout=30)
            if p.is_alive():
                p.kill()
                p.join(5)
        out = []
        for i, (role, p, end) in enumerate(zip(self.roles, self.procs, ends)):
            start = self.start_mem[i] if i < len(self.start_mem) else {}
            out.append(process_memory(role, p.exitcode, start, end, self.held[i], self.peak_anon[i], self.round_rss[i],
                                      self.private))
        bad = failed or [f"{self.label} {o['role']} exited with code {o['exitcode']}" for o in out if o["exitcode"] != 0]
        if bad:
            raise WorkerFailed("; ".join(bad))
        return out


def process_memory(role: str, exitcode, start: dict, end: dict, held: int, peak_anon: int, round_rss: int,
                   private: bool = False) -> dict[str, Any]:
    """One process's line of the memory table. A reader is flagged when its private (anon) memory grew by more
    than the copies of what one round gave it allow: none where the store maps it (shm, Ray's object
    store), one where the shard must land in the reader's own buffer (`private`: Mooncake), each plus 25%
    and SLACK (a store reader has got a tiny partition of its own before its start memory is taken, so its
    first gets' imports and caches are not counted; what is left moves by a few MB). `mapped_beyond_mb`: how far its RSS, holding its shard, grew past the shard's bytes (pages of the store
    it maps but did not read; shared, not a copy)."""
    mb = 1 / 2**20
    rss0, anon = start.get("rss", 0), max(0, peak_anon - start.get("anon", 0))
    out = {"role": role, "exitcode": exitcode, "start_rss_mb": rss0 * mb, "peak_rss_mb": end.get("peak", 0) * mb,
           "round_rss_mb": round_rss * mb, "held_mb": held * mb, "anon_growth_mb": anon * mb,
           "mapped_beyond_mb": max(0, round_rss - rss0 - held) * mb}
    out["copies_shard"] = role.startswith("reader") and anon > held * (1.25 if private else 0.25) + SLACK
    return out
