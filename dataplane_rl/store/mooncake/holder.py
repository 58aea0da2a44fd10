"""A Mooncake holder: a process whose only job is to own store memory.

Mooncake keeps an object's bytes in the process that contributed the segment it was allocated in, so
data dies with that process. Writers and readers therefore contribute nothing (`global_segment_size=0`)
and `MooncakeCluster` starts these dedicated holders instead:

    python -m dataplane_rl.store.mooncake.holder --master 127.0.0.1:50051 \\
        --segment-size 536870912 --ready-file /tmp/x/holder-0.json

It advertises `--local-hostname`, by default this host's address on the route to the master (127.0.0.1 for
a master on loopback; $DATAPLANE_RL_MOONCAKE_HOST overrides it): clients on other hosts connect there.

The holder calls `setup()` contributing `--segment-size` bytes, writes `--ready-file` (JSON: pid and the
segment name the master knows it by) and prints READY, then sleeps. SIGTERM or SIGINT unmounts the
segment (`close()`, about 1 s; its keys then read as OBJECT_NOT_FOUND at once) and exits 0. It also exits
when its parent process goes away. A failed setup exits 2 with the reason on stderr.

Only the standard library, `dataplane_rl.hosts` and `mooncake.store` are imported here, so a holder starts
in well under a second.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import threading
import time

EXIT_SETUP_FAILED = 2
EXIT_NO_MOONCAKE = 3


def _parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m dataplane_rl.store.mooncake.holder",
                                description="Contribute a Mooncake memory segment and hold it until terminated.")
    p.add_argument("--master", required=True, help="master RPC address HOST:PORT")
    p.add_argument("--segment-size", type=int, required=True, help="bytes this holder contributes")
    p.add_argument("--ready-file", default="", help="written (atomically) once the segment is mounted")
    p.add_argument("--local-hostname", default=None,
                   help="address clients reach this holder at (default: this host's IP on the route to the master)")
    p.add_argument("--metadata-server", default="P2PHANDSHAKE")
    p.add_argument("--protocol", default="tcp")
    p.add_argument("--device-name", default="", help="RDMA device(s); empty for tcp")
    p.add_argument("--local-buffer-size", type=int, default=0,
                   help="a holder never reads or writes itself, so it needs no transfer buffer")
    p.add_argument("--parent-pid", type=int, default=0, help="exit when this process is gone (0: do not watch)")
    p.add_argument("--close-timeout", type=float, default=10.0,
                   help="seconds to wait for close() on SIGTERM before exiting anyway")
    return p.parse_args(argv)


def _write_ready(path: str, info: dict) -> None:
    tmp = f"{path}.tmp.{os.getpid()}"
    with open(tmp, "w") as f:
        json.dump(info, f)
    os.replace(tmp, path)


def main(argv: list[str] | None = None) -> int:
    args = _parse(argv)
    try:
        from mooncake.store import MooncakeDistributedStore
    except ImportError as e:  # pragma: no cover - exercised only without the extra
        from dataplane_rl.resources import pip_install_extra

        print(f"mooncake_holder: cannot import mooncake.store ({e}); install the `mooncake` extra "
              f"({pip_install_extra('mooncake')}) and Debian libibverbs1", file=sys.stderr, flush=True)
        return EXIT_NO_MOONCAKE

    stop = threading.Event()

    def _on_signal(signum, _frame):
        stop.set()

    signal.signal(signal.SIGTERM, _on_signal)
    signal.signal(signal.SIGINT, _on_signal)

    from dataplane_rl.hosts import advertise_host

    try:
        host = advertise_host(args.master, args.local_hostname)
    except Exception as e:  # StoreUnavailableError: no route to the master
        print(f"mooncake_holder: {e}", file=sys.stderr, flush=True)
        return EXIT_SETUP_FAILED
    os.environ.setdefault("MC_TCP_BIND_ADDRESS", host)  # Mooncake's address source without P2PHANDSHAKE
    store = MooncakeDistributedStore()
    t0 = time.monotonic()
    rc = store.setup(host, args.metadata_server, args.segment_size, args.local_buffer_size,
                     args.protocol, args.device_name, args.master)
    if rc != 0:
        print(f"mooncake_holder: setup(master={args.master}, local_hostname={host}, segment_size={args.segment_size}, "
              f"protocol={args.protocol}) failed with rc={rc}", file=sys.stderr, flush=True)
        return EXIT_SETUP_FAILED
    info = {"pid": os.getpid(), "segment_name": store.get_hostname(), "segment_size": args.segment_size,
            "master": args.master, "setup_s": round(time.monotonic() - t0, 4)}
    if args.ready_file:
        _write_ready(args.ready_file, info)
    print("READY " + json.dumps(info), flush=True)

    while not stop.wait(0.5):
        if args.parent_pid and os.getppid() != args.parent_pid:
            print("mooncake_holder: parent is gone, exiting", file=sys.stderr, flush=True)
            os._exit(0)  # the master is probably gone too; an unmount RPC would only hang

    # Unmount so the master forgets this segment's keys now rather than after client_ttl.
    closer = threading.Thread(target=store.close, daemon=True)
    closer.start()
    closer.join(args.close_timeout)
    if closer.is_alive():
        print(f"mooncake_holder: close() did not finish in {args.close_timeout}s, exiting anyway",
              file=sys.stderr, flush=True)
        os._exit(0)
    return 0


if __name__ == "__main__":
    sys.exit(main())
