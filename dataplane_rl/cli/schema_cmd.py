"""`dataplane-rl schema show|validate`."""

from __future__ import annotations

import json
import sys
from pathlib import Path


def add_parser(sub) -> None:
    p = sub.add_parser("schema", help="show the declared columns or validate a file of columns")
    ssub = p.add_subparsers(dest="schema_command", required=True, metavar="ACTION")
    show = ssub.add_parser("show", help="list columns: name, dtype, kind, writer, field sets, alias")
    show.add_argument("--schema", default="grpo", help="built-in schema name or YAML path (default: grpo)")
    show.add_argument("--field-set", help="only the columns of this field set, in its order")
    show.add_argument("--json", action="store_true", help="machine-readable output")
    _config_arguments(show, "show a shape that names a config value ([distillation.topk_logits_k]) with its value "
                            "in this config (default: the name alone)")
    show.set_defaults(func=show_cmd)
    val = ssub.add_parser("validate", help="check a Parquet or Arrow IPC file of columns against the schema")
    val.add_argument("file", type=Path)
    val.add_argument("--schema", default="grpo", help="built-in schema name or YAML path (default: grpo)")
    val.add_argument("--writer", default="rollout",
                     help="columns that must be present: those of this writer (rollout, driver, policy, reference, teacher) or 'all'")
    _config_arguments(val, "the config whose values fill shapes that name them (default: the config's defaults)")
    val.set_defaults(func=validate_cmd)


def _config_arguments(parser, what: str) -> None:
    parser.add_argument("--config", help=f"YAML run config: {what}")
    parser.add_argument("overrides", nargs="*", metavar="key=value", help="config overrides, as `train` takes them")


def bound_to(schema, args):
    """`schema` bound to the config --config and the overrides make, or None when neither is given."""
    if not args.config and not args.overrides:
        return None
    from dataplane_rl.config import bound_schema, load_config

    return bound_schema(schema, load_config(args.config, args.overrides))


def show_cmd(args) -> int:
    from dataplane_rl.schema import load_schema

    schema = load_schema(args.schema)
    bound = bound_to(schema, args) or schema
    names = schema.field_set(args.field_set) if args.field_set else schema.names
    rows = []
    for name in names:
        c = schema.column(name)
        rows.append({"name": c.name, "dtype": c.dtype, "kind": c.kind, "shape": list(bound.column(name).shape),
                     "writer": c.writer, "field_sets": schema.sets_of(c.name), "alias": schema.aliases.get(c.name),
                     "doc": c.doc})
        if not c.bound and bound is not schema:
            rows[-1]["declared_shape"] = list(c.shape)
    if args.json:
        json.dump({"schema": schema.name, "version": schema.version, "source": schema.source,
                   "columns": rows, "field_sets": {k: list(v) for k, v in schema.field_sets.items()},
                   "aliases": schema.aliases}, sys.stdout, indent=2)
        print()
        return 0
    header = ("name", "dtype", "kind", "shape", "writer", "field sets", "alias")
    table = [(r["name"], r["dtype"], r["kind"], shape_text(schema.column(r["name"]), bound.column(r["name"])), r["writer"],
              ",".join(r["field_sets"]) or "-", r["alias"] or "-") for r in rows]
    widths = [max(len(h), *(len(t[i]) for t in table)) for i, h in enumerate(header)]
    title = f"schema {schema.name} v{schema.version} ({shown_path(schema.source)})"
    print(title + (f", field set {args.field_set}" if args.field_set else ""))
    print("  ".join(h.ljust(w) for h, w in zip(header, widths)))
    for t in table:
        print("  ".join(v.ljust(w) for v, w in zip(t, widths)))
    return 0


def shape_text(declared, bound) -> str:
    """A column's shape as the file declares it, a named dimension with its value when bound: [distillation.topk_logits_k=16]."""
    if not declared.shape:
        return "-"
    return f"[{', '.join(f'{d}={b}' if d != b else str(d) for d, b in zip(declared.shape, bound.shape))}]"


def shown_path(source) -> str:
    """A schema file inside the checkout as the README names it (schema/grpo.yaml); any other absolute."""
    from dataplane_rl.resources import project_root

    path, root = Path(str(source)).resolve(), project_root()
    return str(path.relative_to(root)) if root is not None and path.is_relative_to(root) else str(source)


def read_columns(path: Path):
    """Read a Parquet or Arrow IPC (file or stream) table."""
    import pyarrow as pa
    import pyarrow.ipc as ipc
    import pyarrow.parquet as pq

    from dataplane_rl.errors import SchemaError

    if not path.is_file():
        raise SchemaError(f"file '{path}' not found")
    with open(path, "rb") as f:
        magic = f.read(6)
    try:
        if magic[:4] == b"PAR1":
            # read_table fails on a name given twice with an ArrowInvalid that names neither file nor column
            names = pq.read_schema(path).names
            twice = sorted({n for n in names if names.count(n) > 1})
            if twice:
                raise SchemaError(f"file '{path}' has column(s) {', '.join(map(repr, twice))} more than once; "
                                  "write each column once")
            return pq.read_table(path)
        if magic == b"ARROW1":
            return ipc.open_file(path).read_all()
        return ipc.open_stream(pa.memory_map(str(path))).read_all()
    except (pa.ArrowInvalid, OSError) as e:
        raise SchemaError(f"file '{path}' is neither Parquet nor Arrow IPC: {e}") from None


def validate_cmd(args) -> int:
    from dataplane_rl.schema import Violation, load_schema

    schema = load_schema(args.schema)
    if not schema.bound:  # a shape names a config value: the given config's, else its default (as a store binds)
        from dataplane_rl.config import bound_schema

        schema = bound_to(schema, args) or bound_schema(schema)
    table = read_columns(args.file)
    found = schema.violations(table)
    required = schema.names if args.writer == "all" else [c.name for c in schema.columns if c.writer == args.writer]
    if not required and args.writer != "all":
        print(f"error: --writer '{args.writer}' writes no column; use one of rollout, driver, policy, reference, teacher, all",
              file=sys.stderr)
        return 2
    for name in required:
        if name not in table.column_names:
            found.append(Violation(name, f"declared column (writer {schema.column(name).writer}) missing from the file; "
                                         "write it or pass --writer to check another writer's columns"))
    if not found:
        print(f"{args.file}: {table.num_rows} rows, {table.num_columns} columns match schema '{schema.name}'")
        return 0
    print(f"{args.file}: {len(found)} violation(s) of schema '{schema.name}':", file=sys.stderr)
    for v in found:
        print(f"  {v}", file=sys.stderr)
    return 1
