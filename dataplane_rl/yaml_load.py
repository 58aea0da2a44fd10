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
