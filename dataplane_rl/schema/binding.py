"""A schema bound to a run's config: shape dimensions that name a config value (distillation.topk_logits_k) get it."""

from __future__ import annotations

import difflib
from typing import Any, Mapping

from pydantic import ValidationError

from dataplane_rl.errors import SchemaError

_MISSING = object()


def config_value(schema: "Schema", column: "Column", key: str, config: Any) -> int:
    """The value of `key` ('distillation.topk_logits_k') in `config` (a run's Config, or any object or mapping
    holding that key), refused unless it is a whole number >= 1."""
    where = f"schema file '{schema.source}' column '{column.name}': shape names '{key}'"
    node = config
    for part in key.split("."):
        if isinstance(node, Mapping):
            parent, node = node, node.get(part, _MISSING)
        else:
            parent, node = node, getattr(node, part, _MISSING)
        if node is _MISSING:
            fields = list(parent) if isinstance(parent, Mapping) else list(getattr(type(parent), "model_fields", ()))
            match = difflib.get_close_matches(part, fields, n=1)
            hint = f" (did you mean '{match[0]}'?)" if match else ""
            raise SchemaError(f"{where}, which is not a config key ('{part}' not found{hint}); name a config key "
                              "that holds a whole number, e.g. shape: [distillation.topk_logits_k]")
    if type(node) is not int or node < 1:
        raise SchemaError(f"{where}, which is {node!r} in this config, not a whole number >= 1; name a config key "
                          "that holds a dimension, or write the number")
    return node


def bind(schema: "Schema", config: Any) -> "Schema":
    """`schema` with each shape dimension that names a config value replaced by that value in `config`."""
    values = {(c.name, d): config_value(schema, c, d, config)
              for c in schema.columns for d in c.shape if isinstance(d, str)}
    if not values:
        return schema
    key = tuple(sorted(values.items()))
    cache = schema.bindings
    if key not in cache:
        try:
            columns = tuple(c if c.bound else type(c)(**{**c.model_dump(), "shape": [values.get((c.name, d), d)
                                                                                      for d in c.shape]})
                            for c in schema.columns)
            cache[key] = type(schema)(**{**schema.model_dump(), "columns": columns}, source=schema.source)
        except ValidationError as e:  # a dimension the column refuses (too many values per token)
            msg = "; ".join(err["msg"].removeprefix("Value error, ") for err in e.errors())
            named = ", ".join(sorted({f"{k}={v}" for (_, k), v in values.items()}))
            raise SchemaError(f"schema file '{schema.source}' bound to the config ({named}): {msg}") from None
    return cache[key]
