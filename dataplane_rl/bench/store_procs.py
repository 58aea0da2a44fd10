"""`bench store`'s processes: N writers and M readers started once, released together round after round."""

from __future__ import annotations

import multiprocessing as mp
import time
from typing import Any, Callable

from dataplane_rl.bench.store_work import memory

SLACK = 24 * 2**20  # private memory a reader may grow by beyond its copies of its shard
BARRIER_S = 300  # a worker waits this long at most for its peers (a dead peer breaks the barrier sooner)


def serve(conn, barrier, setup: Callable[[], tuple[Callable, Callable]], profile: str = "") -> None:
    """A worker's life: `setup()` gives (handle, close); each message but None is handled after the other
    workers of the role reach the barrier (except ("rows", ...) asks, served alone) and answered with
    handle's dict; None ends it with ("bye", its memory with the peak). With `profile`, the
    handled calls run under cProfile, dumped there at the end."""
    handle, close = setup()
    prof = None
    if profile:
        import cProfile

        prof = cProfile.Profile()
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


def recv(conn, procs, timeout: float = 300):
    """The next message from a worker, or an error if none comes in `timeout` s or a worker died."""
    deadline = time.monotonic() + timeout
    while not conn.poll(0.2):
        dead = [p for p in procs if not p.is_alive()]
        if dead:
            raise RuntimeError(f"benchmark {dead[0].name} exited with {dead[0].exitcode} (its traceback is above)")
        if time.monotonic() > deadline:
            raise RuntimeError(f"no answer from a benchmark worker in {timeout:g} s")
    return conn.recv()


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
        for c in self.conns:
            msg = recv(c, self.procs, 120)
            if msg[0] != "ready":
                raise RuntimeError(f"{self.label}: a benchmark worker failed to start")
            self.start_mem.append(msg[1])

    def ask_all(self, conns, msg, track: bool = True) -> list[dict]:
        """Send msg to each of conns and gather their answers; with `track`, note what each one held."""
        for c in conns:
            c.send(msg)
        out = [recv(c, self.procs) for c in conns]
        for c, o in zip(conns, out if track else []):
            i = self.conns.index(c)
            self.held[i] = max(self.held[i], o.get("bytes", 0))
            self.peak_anon[i] = max(self.peak_anon[i], o.get("mem", {}).get("anon", 0))
            self.round_rss[i] = max(self.round_rss[i], o.get("mem", {}).get("rss", 0))
        return out

    def ask(self, i: int, msg) -> dict:
        """Reader i alone (no barrier): a ("rows", ...) request of the small calls, whose memory is not a round's."""
        return self.ask_all([self.readers[i]], msg, track=False)[0]

    def abort(self) -> None:
        """Stop every worker after an error, which stays the one raised: a worker's failure is only printed."""
        try:
            self.close()
        except RuntimeError as e:
            import sys

            print(f"[bench] {e}", file=sys.stderr)

    def close(self) -> list[dict[str, Any]]:
        """Stop every worker; each one's role, exit status and memory (MB). Raises if one did not exit 0."""
        ends = []
        for c in self.conns:
            try:
                c.send(None)
            except OSError:
                pass
        for c in self.conns:  # each its own: a worker that said bye may be gone while the next closes its store
            try:
                msg = c.recv() if c.poll(60) else ("late",)
                ends.append(msg[1] if msg[0] == "bye" else {})
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
        bad = [f"{self.label} {o['role']} exited with {o['exitcode']}" for o in out if o["exitcode"] != 0]
        if bad:
            raise RuntimeError("; ".join(bad) + " (its traceback is above)")
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
