"""`dataplane-rl config show`: the resolved, validated config."""

from __future__ import annotations


def add_parser(sub) -> None:
    p = sub.add_parser("config", help="show the resolved config")
    csub = p.add_subparsers(dest="config_command", required=True, metavar="ACTION")
    show = csub.add_parser("show", help="print the resolved, validated config as YAML")
    show.add_argument("--config", help="YAML config (default: the embedded grpo_tiny.yaml)")
    show.add_argument("--reference", action="store_true", help="print the table of every key, default and doc")
    show.add_argument("overrides", nargs="*", metavar="key=value")
    show.set_defaults(func=show_cmd)


def show_cmd(args) -> int:
    from dataplane_rl.config import config_reference, dump_config, load_config

    if args.reference:
        print(config_reference())
        return 0
    print(dump_config(load_config(args.config, args.overrides)), end="")
    return 0
