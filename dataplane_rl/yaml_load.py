"""YAML for config and schema files: yaml.safe_load, but a key given twice is an error.

PyYAML keeps the last of two equal keys silently, so a config with the `grpo:` section twice ran with
the second one only. No maintained loader on PyYAML's SafeLoader refuses them (ruamel.yaml does, but it
is a second YAML library for one check), so this subclass checks each mapping as it is built.
"""

from __future__ import annotations

import yaml


class _UniqueKeyLoader(yaml.SafeLoader):
    def construct_mapping(self, node, deep=False):
        seen = set()
        for key_node, _ in node.value:
            key = self.construct_object(key_node, deep=deep)
            if key in seen:
                raise yaml.constructor.ConstructorError(
                    "while constructing a mapping", node.start_mark,
                    f"found key '{key}' twice (line {key_node.start_mark.line + 1}); keep one, the second would win "
                    "silently", key_node.start_mark)
            seen.add(key)
        return super().construct_mapping(node, deep=deep)


def load_yaml(text: str):
    """yaml.safe_load that refuses a mapping key given twice (a yaml.YAMLError naming key and line)."""
    return yaml.load(text, Loader=_UniqueKeyLoader)  # noqa: S506 - a SafeLoader subclass


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
