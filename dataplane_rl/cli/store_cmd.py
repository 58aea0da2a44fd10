"""`dataplane-rl store ls|show|export|drop|gc`: look into (or export, or free) a live column store, by URL or
by a run folder: a live run's (its store.json names the store) or one that kept its partitions (its summary.json); list this
machine's shm stores with their owners, and remove those of dead runs (store/shm/owners.py)."""

from __future__ import annotations

import dataclasses
import json
import shutil
import sys
from pathlib import Path
from dataplane_rl.units import human_bytes

SHOW_DEFAULT_ROWS = "0-9"


def add_parser(sub) -> None:
    p = sub.add_parser("store", help="inspect a live column store (shm://DIR, mooncake://HOST:PORT, ray://...)")
    ssub = p.add_subparsers(dest="store_command", required=True, metavar="ACTION")
    ls = ssub.add_parser("ls", help="partitions, columns, rows written of total, bytes; without a URL, this "
                         "machine's shm stores with owner, size and state (live, kept, orphaned)")
    ls.add_argument("url", nargs="?", help=URL_HELP)
    ls.add_argument("--json", action="store_true", help="machine-readable output")
    ls.set_defaults(func=ls_cmd)
    show = ssub.add_parser("show", help="print rows of a partition (token columns abbreviated)")
    show.add_argument("url", help=URL_HELP)
    show.add_argument("partition", help="partition id, e.g. step-000042")
    show.add_argument("--rows", default=SHOW_DEFAULT_ROWS, help=f"rows like 0-9,12 (default {SHOW_DEFAULT_ROWS})")
    show.add_argument("--fields", help="comma-separated columns (default: every column with rows written)")
    show.set_defaults(func=show_cmd)
    export = ssub.add_parser("export", help="write a partition's rows to a Parquet file (token columns as lists, "
                             "shaped ones as lists of fixed-size lists, the schema in the file's metadata)")
    export.add_argument("url", help=URL_HELP)
    export.add_argument("partition", help="partition id, e.g. step-000042")
    export.add_argument("out", type=Path, help="the Parquet file to write, e.g. step-000042.parquet")
    export.add_argument("--fields", help="comma-separated columns (default: every column written on every row)")
    export.set_defaults(func=export_cmd)
    drop = ssub.add_parser("drop", help="drop a partition, or --all (an shm:// store's folder goes with the last)")
    drop.add_argument("url", help=URL_HELP)
    which = drop.add_mutually_exclusive_group(required=True)
    which.add_argument("partition", nargs="?", help="partition id, e.g. step-000042")
    which.add_argument("--all", action="store_true", help="every partition; an shm:// folder is then removed")
    drop.add_argument("--force", action="store_true", help="drop even from a store a live run is using (that run "
                      "then fails)")
    drop.set_defaults(func=drop_cmd)
    gc = ssub.add_parser("gc", help="remove the auto-made shm stores of dead runs that were not kept "
                         "(also done at each `train` start)")
    gc.set_defaults(func=gc_cmd)


URL_HELP = ("store URL (shm:///dev/shm/dataplane-rl-..., mooncake://HOST:PORT, ...) or a run folder: a live run's, "
            "or one with data_plane.keep_partitions=true, e.g. runs/latest")


def store_url(arg: str) -> str:
    """A store URL as given, or a run folder's store: the one its summary.json records as kept once the run
    has ended, else (a live run) the one its store.json names."""
    from dataplane_rl.errors import ConfigError

    if "://" in arg:
        return arg
    summary, live = Path(arg) / "summary.json", Path(arg) / "store.json"
    if not summary.is_file() and live.is_file():
        url = json.loads(live.read_text()).get("store_url")
        if not url:
            raise ConfigError(f"the run in '{arg}' has the data plane off: its columns live in the driver's "
                              "memory; run with data_plane.enabled=true to inspect its store")
        return url
    if not summary.is_file():
        raise ConfigError(f"'{arg}' is neither a store URL (shm://DIR, mooncake://HOST:PORT, ...) nor a run folder "
                          "(with store.json or summary.json)")
    doc = json.loads(summary.read_text())
    if not doc.get("kept_store_url"):
        raise ConfigError(f"the run in '{arg}' kept no partitions: its store ended with it; run with "
                          "data_plane.enabled=true data_plane.keep_partitions=true to inspect them afterwards")
    return doc["kept_store_url"]


def _open(arg: str, **options):
    from dataplane_rl.store import open_store

    url = store_url(arg)
    # looking must not create: a mistyped shm:// folder is an error, not a new empty store
    return open_store(url, create=False, **options) if url.startswith("shm://") else open_store(url, **options)


def parse_rows(text: str, num_rows: int | None = None) -> list[int]:
    """'0-9,12' -> [0, ..., 9, 12]. With num_rows, a row past the partition is refused before any range is
    built (a typo like 0-99999999999 would otherwise take gigabytes first)."""
    from dataplane_rl.errors import ConfigError

    rows: list[int] = []
    for part in text.split(","):
        a, sep, b = part.strip().partition("-")
        try:
            lo, hi = int(a), int(b) if sep else int(a)
        except ValueError:
            raise ConfigError(f"--rows {text!r}: '{part}' is not a row or a range like 0-9") from None
        if lo > hi:
            raise ConfigError(f"--rows {text!r}: '{part}' ends before it starts")
        if num_rows is not None and hi >= num_rows:
            raise ConfigError(f"--rows {text!r}: row {hi} is out of range; the partition has {num_rows} rows "
                              f"(0-{num_rows - 1})" if num_rows else f"--rows {text!r}: the partition has no rows")
        rows.extend(range(lo, hi + 1))
    return rows


def describe(store) -> dict:
    """Each partition's columns, rows and bytes; a damaged one is marked (`damaged`: its error) and the rest
    are listed all the same."""
    from dataplane_rl.errors import DataPlaneError, PartitionNotFoundError

    out = {"url": store.url, "partitions": []}
    for pid in store.list_partitions():
        try:
            st = store.status(pid)
            schema = store.schema(pid)
        except PartitionNotFoundError:  # dropped since it was listed
            continue
        except DataPlaneError as e:
            out["partitions"].append({"partition": pid, "damaged": f"{type(e).__name__}: {e}", "nbytes": 0})
            continue
        cols = {c.name: {"rows_written": st.rows_written[c.name], "nbytes": st.nbytes[c.name], "writer": c.writer,
                         "shape": list(c.shape)} for c in schema.columns}
        out["partitions"].append({"partition": pid, "schema": st.schema, "num_rows": st.num_rows,
                                  "nbytes": st.total_bytes, "columns": cols})
    out["stats"] = store.stats()
    return out


def print_stats(stats: dict) -> None:
    """The store's counters and gauges (ColumnStore.stats), one `name value` per line, Prometheus style."""
    print("\ncounters and gauges (every process of the store that shared them; see docs/store.md):")
    for name, value in stats.items():
        print(f"  {name} {value:.6g}" if isinstance(value, float) else f"  {name} {value}")


def ls_machine(as_json: bool) -> int:
    from dataplane_rl.store.shm import owners

    found = owners.scan()
    if as_json:
        json.dump([dataclasses.asdict(e) for e in found], sys.stdout, indent=2)
        print()
        return 0
    print(f"{len(found)} shm store(s) of this user in {owners.auto_root()}, "
          f"{human_bytes(sum(e.nbytes for e in found))}")
    for e in found:
        print(f"  {e.path}  {e.state:8}  {human_bytes(e.nbytes):>10}  owner {e.owner_text()}")
    if any(e.state == "orphaned" for e in found):
        print("free the orphaned ones: dataplane-rl store gc")
    return 0


def gc_cmd(args) -> int:
    from dataplane_rl.store.shm import owners

    removed = owners.collect(say=print)
    print(f"removed {len(removed)} orphaned store(s), {sum(e.nbytes for e in removed)} bytes "
          f"({human_bytes(sum(e.nbytes for e in removed))})")
    return 0


def ls_cmd(args) -> int:
    if args.url is None:
        return ls_machine(args.json)
    store = _open(args.url)
    try:
        doc = describe(store)
    finally:
        store.close()
    if args.json:
        json.dump(doc, sys.stdout, indent=2)
        print()
        return 0
    parts = doc["partitions"]
    print(f"store {doc['url']}: {len(parts)} partition(s), {human_bytes(sum(p['nbytes'] for p in parts))}")
    for p in parts:
        if "damaged" in p:
            print(f"\n{p['partition']}  DAMAGED: {p['damaged']}")
            continue
        print(f"\n{p['partition']}  schema {p['schema']}  {p['num_rows']} rows  {human_bytes(p['nbytes'])}")
        width = max(len(c) for c in p["columns"])
        for name, c in p["columns"].items():
            written = f"{c['rows_written']}/{p['num_rows']}"
            mark = "" if c["rows_written"] == p["num_rows"] else ("  (none)" if not c["rows_written"] else "  (partial)")
            shape = f"  [L, {', '.join(map(str, c['shape']))}]" if c["shape"] else ""
            print(f"  {name.ljust(width)}  {written:>13}  {human_bytes(c['nbytes']):>10}  {c['writer']}{shape}{mark}")
    print_stats(doc["stats"])
    damaged = [p["partition"] for p in parts if "damaged" in p]
    if damaged:
        print(f"{len(damaged)} damaged partition(s): {', '.join(damaged)}; drop each with "
              f"dataplane-rl store drop {args.url} PARTITION", file=sys.stderr)
    return 0


def _cell(value, token: bool, shape: str = "") -> str:
    if value is _MISSING:
        return repr(value)
    if token:
        return f"{_scalar(value)} ({len(value)} tokens" + (f" of {shape})" if shape else ")")
    return _scalar(value)


def _scalar(v) -> str:
    if isinstance(v, list):  # a token list, or one token of a shaped column: its first 4 and last values
        head = ", ".join(_scalar(x) for x in v[:4])
        tail = f", …, {_scalar(v[-1])}" if len(v) > 5 else "".join(f", {_scalar(x)}" for x in v[4:])
        return f"[{head}{tail}]"
    if isinstance(v, float):
        return f"{v:.6g}"
    if isinstance(v, str):
        return repr(v if len(v) <= 60 else v[:57] + "...")
    return str(v)


def _cell_or_missing(store, pid: str, field: str, row: int):
    from dataplane_rl.errors import MissingColumnError

    try:
        return store.get(pid, [field], [row]).column(0)[0].as_py()
    except MissingColumnError:
        return _MISSING


class _Missing:
    def __repr__(self) -> str:
        return "(not written)"


_MISSING = _Missing()


def show_cmd(args) -> int:
    from dataplane_rl.errors import MissingColumnError, format_rows

    store = _open(args.url)
    try:
        status = store.status(args.partition)
        schema = store.schema(args.partition)
        rows = [r for r in parse_rows(args.rows) if r < status.num_rows] if args.rows == SHOW_DEFAULT_ROWS \
            else parse_rows(args.rows, status.num_rows)
        fields = field_list(args.fields)
        if fields:
            table = store.get(args.partition, fields, rows)  # an unwritten field is an error, as in the API
            columns = {f: table.column(f).to_pylist() for f in fields}
        else:
            columns = {}
            for f in (c for c in schema.names if status.rows_written[c]):
                try:
                    columns[f] = store.get(args.partition, [f], rows).column(0).to_pylist()
                except MissingColumnError as e:  # partly written: show the written cells, mark the rest
                    print(f"# {e}", file=sys.stderr)
                    columns[f] = [_cell_or_missing(store, args.partition, f, r) for r in rows]
        stats = store.stats([args.partition])  # this partition's cells: another one's damage is not this one's
    finally:
        store.close()
    print(f"partition {args.partition}: schema {status.schema}, {status.num_rows} rows; showing rows "
          f"{format_rows(rows)}")
    width = max((len(f) for f in columns), default=0)
    for i, r in enumerate(rows):
        print(f"row {r}")
        for f, values in columns.items():
            col = schema.by_name[f]
            print(f"  {f.ljust(width)}  {_cell(values[i], col.kind == 'token', col.shape_text)}")
    print_stats(stats)
    return 0


def field_list(text: str | None) -> list[str] | None:
    """--fields 'a,b' -> ['a', 'b']; None when not given. Given but naming no column (`--fields ''`) is an
    error, not every column."""
    if text is None:
        return None
    fields = [f.strip() for f in text.split(",") if f.strip()]
    if not fields:
        from dataplane_rl.errors import ConfigError

        raise ConfigError(f"--fields {text!r} names no column; name them, e.g. --fields input_ids,total_reward, "
                          "or leave --fields out for every written column")
    return fields


def export_cmd(args) -> int:
    from dataplane_rl.store.parquet import export_partition
    from dataplane_rl.store.targets import check_target, writing

    fields = field_list(args.fields)
    out = check_target(args.out, "store export OUT")  # before the store is opened: nothing is read for a bad target
    store = _open(args.url)
    try:
        with writing(args.out, "store export OUT"):
            rows, fields = export_partition(store, args.partition, out, fields)
    finally:
        store.close()
    print(f"wrote {args.out}: partition {args.partition}, {rows} rows, {len(fields)} columns ({', '.join(fields)})")
    return 0


def drop_cmd(args) -> int:
    # pool_bytes=0: a dropped partition's chunk files are deleted, not pooled for reuse by a run that is over
    url = store_url(args.url)
    store = _open(url, **({"pool_bytes": 0} if url.startswith("shm://") else {}))
    try:
        if not args.force:
            refuse_live(store, args)
        pids = store.list_partitions() if args.all else [args.partition]
        for pid in pids:
            store.drop_partition(pid)
        folder = store.path if args.all and hasattr(store, "path") else None
    finally:
        store.close()
    print(f"dropped {len(pids)} partition(s) from {url}" + (f"; removed {folder}" if folder else ""))
    if folder is not None:
        shutil.rmtree(folder)  # the store is empty; its folder (marker, chunk pool) is all that is left
    return 0


def refuse_live(store, args) -> None:
    """A ConfigError if a live process owns the store (its owner record: store/shm/owners.py): dropping from
    under a run once made it die with a remote traceback. Only shm stores record their owner."""
    from dataplane_rl.errors import ConfigError
    from dataplane_rl.store.shm import owners

    folder = getattr(store, "path", None)
    owner = owners.read_owner(str(folder)) if folder is not None else None
    if not owner or not owners.owner_alive(owner):
        return
    raise ConfigError(f"store {args.url} is in use by a live run (pid {owner['pid']} on {owner['host']}: "
                      f"{_command_of(int(owner['pid']))}); stop that run first, or pass --force to drop from it "
                      f"anyway: dataplane-rl store drop --force {args.url} {'--all' if args.all else args.partition}")


def _command_of(pid: int) -> str:
    import psutil

    try:
        words = psutil.Process(pid).cmdline()
    except psutil.Error:
        return "command unknown"
    text = " ".join(words)
    return text if len(text) <= 120 else text[:117] + "..."
