"""YAML for config and schema files and `key=value` overrides: YAML 1.2's core schema, a key given twice refused.

PyYAML implements YAML 1.1, whose plain scalars surprise: `no`, `off` and `y` are booleans, `0123` is octal
(83), `1:30` is sexagesimal (90), `2024-01-01` a date, while `1e-6` stays a string. A reward kwarg `lang=no`
became False. The loader here resolves plain scalars by YAML 1.2's core schema instead (what YAML 1.2 parsers
such as ruamel.yaml read): null is `null`/`~`/empty, booleans only `true`/`false` (any case of the first
letter, or all capitals), integers decimal (`0123` is 123), `0o17` or `0x1F`, floats with an optional exponent
(`1e-6`), `.inf` and `.nan`; everything else is a string. Merge keys (`<<: *anchor`), a YAML 1.1 addition
most loaders keep, are accepted; a key written out in the mapping wins over a merged one.

PyYAML also keeps the last of two equal keys silently, so a config with the `grpo:` section twice ran with
the second one only: each mapping is checked as it is built (merged keys aside, which the mapping may
override). The dumper quotes every string that either YAML 1.1 or 1.2 would read as something else, so a
config.yaml written here reads back the same with this loader and with yaml.safe_load.
"""

from __future__ import annotations

import re

import yaml

MERGE_TAG = "tag:yaml.org,2002:merge"
# YAML 1.2.2 §10.3.2, the core schema's tag resolution: (tag, pattern, first characters)
CORE_SCALARS = [
    ("tag:yaml.org,2002:null", r"^(?:~|null|Null|NULL|)$", ["~", "n", "N", ""]),
    ("tag:yaml.org,2002:bool", r"^(?:true|True|TRUE|false|False|FALSE)$", list("tTfF")),
    ("tag:yaml.org,2002:int", r"^(?:[-+]?[0-9]+|0o[0-7]+|0x[0-9a-fA-F]+)$", list("-+0123456789")),
    ("tag:yaml.org,2002:float", r"^(?:[-+]?(?:\.[0-9]+|[0-9]+(?:\.[0-9]*)?)(?:[eE][-+]?[0-9]+)?"
                                r"|[-+]?\.(?:inf|Inf|INF)|\.(?:nan|NaN|NAN))$", list("-+.0123456789")),
]


class DuplicateKeyError(yaml.constructor.ConstructorError):
    """A mapping with a key given twice."""


class _CoreLoader(yaml.SafeLoader):
    yaml_implicit_resolvers: dict = {}  # its own table, not SafeLoader's YAML 1.1 one

    def construct_yaml_int(self, node):
        text = self.construct_scalar(node)
        sign, digits = (-1, text[1:]) if text.startswith("-") else (1, text.removeprefix("+"))
        base = {"0o": 8, "0x": 16}.get(digits[:2].lower(), 10)
        return sign * int(digits[2:] if base != 10 else digits, base)

    def construct_mapping(self, node, deep=False):
        if isinstance(node, yaml.MappingNode):
            seen = set()
            for key_node, _ in node.value:
                if key_node.tag == MERGE_TAG:
                    continue
                key = self.construct_object(key_node, deep=deep)
                if key in seen:
                    raise DuplicateKeyError(
                        "while constructing a mapping", node.start_mark,
                        f"found key '{key}' twice (line {key_node.start_mark.line + 1}); keep one, the second would "
                        "win silently", key_node.start_mark)
                seen.add(key)
        return super().construct_mapping(node, deep=deep)


for _tag, _pattern, _first in CORE_SCALARS:
    _CoreLoader.add_implicit_resolver(_tag, re.compile(_pattern), _first)
_CoreLoader.add_implicit_resolver(MERGE_TAG, re.compile(r"^(?:<<)$"), ["<"])
_CoreLoader.add_constructor("tag:yaml.org,2002:int", _CoreLoader.construct_yaml_int)


class _Dumper(yaml.SafeDumper):
    """SafeDumper's YAML 1.1 resolvers plus the core schema's: a string either would read as another type is quoted."""


for _tag, _pattern, _first in CORE_SCALARS:
    _Dumper.add_implicit_resolver(_tag, re.compile(_pattern), _first)


def load_yaml(text: str):
    """YAML by the 1.2 core schema, with merge keys; a mapping key given twice is a DuplicateKeyError (a
    yaml.YAMLError) naming the key and its line."""
    return yaml.load(text, Loader=_CoreLoader)  # noqa: S506 - a SafeLoader subclass


def dump_yaml(data) -> str:
    """`data` as block YAML, keys in their order, that load_yaml (and yaml.safe_load) read back as it was."""
    return yaml.dump(data, Dumper=_Dumper, sort_keys=False)


def load_yaml_mapping(path, error: type[Exception], kind: str, fix: str, shape: str, empty_ok: bool = False) -> dict:
    """The mapping a YAML file holds, for config and schema files alike: `error` names the file (`kind`
    'path'), what is wrong and `fix` when it is not UTF-8 or not YAML, and `shape` when it is no mapping
    (an empty file is an empty mapping where `empty_ok`)."""
    try:
        tree = load_yaml(path.read_bytes().decode())
    except UnicodeDecodeError as e:
        raise error(f"{kind} '{path}' is not UTF-8 text ({e.reason} at byte {e.start}); {fix}") from None
    except yaml.YAMLError as e:
        raise error(f"{kind} '{path}' is not valid YAML: {e}") from None
    if tree is None and empty_ok:
        return {}
    if not isinstance(tree, dict):
        raise error(f"{kind} '{path}' must hold {shape}")
    return tree
