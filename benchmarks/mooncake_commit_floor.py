"""What a commit costs on Mooncake, before any of this store's code: protocol floors against raw Mooncake.

    python benchmarks/mooncake_commit_floor.py --group-size 8 --rounds 7

N writer processes put a step (4096 rows, 161 MB, as `bench store`'s headline) in groups of G rows, one object
per group, rounds released together; each mode is one way to publish a group, with no Python beyond the calls:
  raw       one batch_put_from per group: `bench store`'s raw Mooncake, no commit at all
  session   a put session for the object and a 200-byte record key: start both, fill both in one call, publish
            the object, then the record (what a reader that sees the record needs: every block is there)
  one_end   the same, object and record published in one call (no order between them)
  claims    one_end plus a 1-byte claim key per cell (8 rows x 9 columns at G=8), put-if-absent: the write-once
            check of per-writer logs that read nothing of each other
  claims9   one_end plus one claim key per column of the group's rows (9): the least a claim can cost, if
            every put's rows were one aligned granule (they are not in general)
  log       one commit log shared by the writers: the object and the next slot in one session; a writer that
            lost the slot publishes the object, finds the first free slot (one batch_is_exist) and takes it,
            asking again while the slot it found is reserved and not yet published (as the store waits for it)
  log_next  the same, but a writer that finds a slot reserved takes the one after it at once (a store doing
            so must still wait for that slot's record before publishing its own: its conflict check)
  sequencer the object in one batch_put_from as raw's, then its record to a sequencer process over TCP on
            127.0.0.1 (one round trip; token checked at connect), which checks the rows against a bitmap,
            appends the record and answers its position: a commit that coordinates outside Mooncake
  sequencer_unix  the same over a Unix socket: what the round trip costs at its cheapest (one host only)
The ratio is raw's median round over the mode's: a store whose commit is one of these cannot beat it.
Prints one line per mode, and the lost slots of `log`.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import statistics
import struct
import time
import uuid

import numpy as np

ROWS, STEP_BYTES, RECORD = 4096, 161 << 20, 200
MODES = ("raw", "session", "one_end", "claims", "claims9", "log", "log_next", "sequencer", "sequencer_unix")
_COMMIT = struct.Struct("<qqq")  # a sequencer request: round, first row, end row (then the record's bytes)


def _sequencer(conn, token: bytes) -> None:
    """A commit sequencer: one thread per writer's connection; a commit is refused if any of its rows is in
    the round's bitmap, else appended. Sends its port and socket path, then serves until the parent closes
    the pipe."""
    import hmac
    import socket
    import tempfile
    import threading

    lock, rounds = threading.Lock(), {}

    def serve(sock: socket.socket) -> None:
        with sock:
            if not hmac.compare_digest(_recv(sock, len(token)), token):
                return
            while head := _recv(sock, _COMMIT.size + RECORD):
                r, lo, hi = _COMMIT.unpack_from(head)
                with lock:
                    bits, log = rounds.setdefault(r, (bytearray(ROWS), []))
                    if bits.find(1, lo, hi) >= 0:
                        at = -1
                    else:
                        bits[lo:hi] = b"\x01" * (hi - lo)
                        log.append(head[_COMMIT.size:])
                        at = len(log) - 1
                    rounds.pop(r - 2, None)
                sock.sendall(at.to_bytes(8, "little", signed=True))

    def accept(listener: socket.socket) -> None:
        while True:
            sock = listener.accept()[0]
            if sock.family == socket.AF_INET:
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            threading.Thread(target=serve, args=(sock,), daemon=True).start()

    tcp = socket.create_server(("127.0.0.1", 0))
    with tempfile.TemporaryDirectory() as folder:  # 0700: only this user reaches the socket
        unix = socket.socket(socket.AF_UNIX)
        unix.bind(f"{folder}/sequencer.sock")
        unix.listen()
        for listener in (tcp, unix):
            threading.Thread(target=accept, args=(listener,), daemon=True).start()
        conn.send((tcp.getsockname()[1], f"{folder}/sequencer.sock"))
        try:
            conn.recv()
        except EOFError:
            pass


def _recv(sock, n: int) -> bytes:
    """Exactly n bytes, or b"" when the peer closed first."""
    buf = bytearray()
    while len(buf) < n:
        got = sock.recv(n - len(buf))
        if not got:
            return b""
        buf += got
    return bytes(buf)


def _writer(conn, master: str, w: int, writers: int, group: int, seq: tuple[int, str, bytes]) -> None:
    import socket

    from dataplane_rl.store.mooncake.client import connect_client, no_eviction_config

    client = connect_client(master, 0)
    tcp = socket.create_connection(("127.0.0.1", seq[0]))
    tcp.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    unix = socket.socket(socket.AF_UNIX)
    unix.connect(seq[1])
    for sock in (tcp, unix):
        sock.sendall(seq[2])
    record = bytes(RECORD)
    r = 0
    mine = list(range(w, ROWS // group, writers))
    size = STEP_BYTES // (ROWS // group)
    arena = np.ones(len(mine) * (size + RECORD), np.uint8)  # pages touched before timing
    base = arena.ctypes.data
    if client.register_buffer(base, arena.nbytes) != 0:
        raise RuntimeError("register_buffer failed")
    pin = no_eviction_config()
    cells = 9 * group
    conn.send("ready")
    while (msg := conn.recv()) is not None:
        mode, prefix, go = msg
        r += 1
        slot = lambda n: f"{prefix}/s/{n}"  # noqa: E731 - the shared log's slots
        known = lost = bad = 0
        while time.monotonic() < go:
            pass
        t0, cpu = time.monotonic(), time.process_time()
        for i, g in enumerate(mine):
            key, rec, at = f"{prefix}/b/{g}", f"{prefix}/r/{g}", base + i * (size + RECORD)
            if mode in ("raw", "sequencer", "sequencer_unix"):
                bad += sum(c != 0 for c in client.batch_put_from([key], [at], [size], pin))
                if mode != "raw":
                    sock = tcp if mode == "sequencer" else unix
                    sock.sendall(_COMMIT.pack(r, g * group, (g + 1) * group) + record)
                    bad += int.from_bytes(_recv(sock, 8) or b"\xff" * 8, "little", signed=True) < 0
            elif mode in ("session", "one_end", "claims", "claims9"):
                n = {"claims": cells, "claims9": 9}.get(mode, 0)
                claims = [f"{prefix}/k/{g}/{j}" for j in range(n)]
                keys = [key, rec] + claims
                bad += sum(c != 0 for c in client.batch_put_session_start(keys, [size, RECORD] + [1] * len(claims), pin))
                got = client.batch_put_from_multi_buffer_ranges(keys, [[at], [at + size]] + [[at]] * len(claims),
                                                                [[size], [RECORD]] + [[1]] * len(claims),
                                                                [[0]] * len(keys))
                bad += sum(c < 0 for c in got)
                ends = [[key], [rec]] if mode == "session" else [keys]
                bad += sum(c != 0 for part in ends for c in client.batch_put_session_end(part))
            else:  # log, log_next
                codes = client.batch_put_session_start([key, slot(known)], [size, RECORD], pin)
                bad += codes[0] != 0
                if codes[1] == 0:
                    got = client.batch_put_from_multi_buffer_ranges([key, slot(known)], [[at], [at + size]],
                                                                    [[size], [RECORD]], [[0], [0]])
                    bad += sum(c < 0 for c in got)
                    bad += sum(c != 0 for c in client.batch_put_session_end([key]))
                    bad += sum(c != 0 for c in client.batch_put_session_end([slot(known)]))
                    known += 1
                    continue
                lost += 1
                bad += sum(c < 0 for c in client.batch_put_from_multi_buffer_ranges([key], [[at]], [[size]], [[0]]))
                bad += sum(c != 0 for c in client.batch_put_session_end([key]))
                while True:
                    if mode == "log":  # the first slot not published yet (a reserved one reads as missing)
                        there = client.batch_is_exist([slot(known + j) for j in range(8)])
                        known += next((j for j, c in enumerate(there) if c != 1), 8)
                    if client.batch_put_session_start([slot(known)], [RECORD], pin)[0] == 0:
                        bad += sum(c < 0 for c in client.batch_put_from_multi_buffer_ranges(
                            [slot(known)], [[at + size]], [[RECORD]], [[0]]))
                        bad += sum(c != 0 for c in client.batch_put_session_end([slot(known)]))
                        known += 1
                        break
                    if mode == "log_next":
                        known += 1  # reserved or published by another writer: the next one
        conn.send((t0, time.monotonic(), time.process_time() - cpu, bad, lost))
        conn.recv()
        client.remove_by_regex(f"^{prefix}/", True)
        conn.send("removed")
    tcp.close()
    unix.close()
    client.close()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--group-size", type=int, default=8, help="rows per put (4096 rows in all)")
    ap.add_argument("--writers", type=int, default=4)
    ap.add_argument("--rounds", type=int, default=7, help="timed rounds per mode, after one warm-up round")
    ap.add_argument("--modes", default=",".join(MODES))
    args = ap.parse_args(argv)
    modes = args.modes.split(",")
    from dataplane_rl.store.mooncake.cluster import MooncakeCluster

    with MooncakeCluster(num_holders=2, global_segment_size=512 << 20) as cluster:
        ctx = mp.get_context("spawn")  # a Mooncake client must not be forked
        token = os.urandom(32)
        seq_conn, child = ctx.Pipe()
        seq = ctx.Process(target=_sequencer, args=(child, token), daemon=True)
        seq.start()
        if not seq_conn.poll(60):
            raise RuntimeError(f"the sequencer (pid {seq.pid}) did not start (exit code {seq.exitcode})")
        port, path = seq_conn.recv()
        workers = []
        for w in range(args.writers):
            parent, child = ctx.Pipe()
            p = ctx.Process(target=_writer, args=(child, cluster.master_address, w, args.writers, args.group_size,
                                                  (port, path, token)), daemon=True)
            p.start()
            workers.append((parent, p))
        for c, p in workers:
            if not c.poll(120) or c.recv() != "ready":
                raise RuntimeError(f"writer pid {p.pid} did not start (exit code {p.exitcode})")
        rounds: dict[str, list] = {m: [] for m in modes}
        for r in range(args.rounds + 1):
            for mode in modes[r % len(modes):] + modes[:r % len(modes)]:  # rotated: no mode always goes first
                prefix, go = f"floor-{uuid.uuid4().hex[:8]}", time.monotonic() + 0.2
                for c, _ in workers:
                    c.send((mode, prefix, go))
                outs = []
                for c, p in workers:
                    if not c.poll(300):
                        raise RuntimeError(f"writer pid {p.pid} did not answer in 300 s (alive: {p.is_alive()})")
                    outs.append(c.recv())
                if r:
                    rounds[mode].append((max(o[1] for o in outs) - min(o[0] for o in outs), sum(o[2] for o in outs),
                                         sum(o[3] for o in outs), sum(o[4] for o in outs)))
                for c, _ in workers:
                    c.send("remove")
                for c, _ in workers:
                    c.recv()
        for c, p in workers:
            c.send(None)
            p.join(30)
        seq_conn.close()
        seq.join(30)
    puts = ROWS // args.group_size
    raw = statistics.median(x[0] for x in rounds["raw"]) if "raw" in rounds else None
    print(f"{args.writers} writers, {puts} puts of {STEP_BYTES // puts} B (groups of {args.group_size}), "
          f"median of {args.rounds} rounds")
    for mode, v in rounds.items():
        wall = statistics.median(x[0] for x in v)
        line = (f"{mode:8s} {STEP_BYTES / wall / 1e9:5.2f} GB/s  round {wall * 1e3:7.1f} ms  CPU "
                f"{statistics.median(x[1] for x in v) * 1e3:7.1f} ms")
        line += f"  x raw {raw / wall:4.2f}" if raw else ""
        line += f"  slots lost {statistics.median(x[3] for x in v):.0f}/{puts}" if mode.startswith("log") else ""
        if any(x[2] for x in v):
            line += f"  FAILED CALLS {sum(x[2] for x in v)}"
        print(line)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
