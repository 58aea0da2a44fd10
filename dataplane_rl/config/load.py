"""Loading a run config: YAML files, dotted key=value overrides, validation, and the generated key reference."""

from __future__ import annotations

import difflib
import json
import os
import typing
from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel, ValidationError

from dataplane_rl.config.foreign_keys import foreign_hint
from dataplane_rl.config.models import Config
from dataplane_rl.errors import ConfigError
from dataplane_rl.resources import data_dir
from dataplane_rl.yaml_load import DuplicateKeyError, dump_yaml, load_yaml, load_yaml_mapping

DEFAULT_CONFIG = "grpo_tiny.yaml"


def default_config_path() -> Path:
    return data_dir("configs") / DEFAULT_CONFIG


def _model_keys(model: type[BaseModel], prefix: str = "") -> dict[str, Any]:
    """Every dotted key of a model, mapped to its field info (sections included)."""
    out: dict[str, Any] = {}
    for name, field in model.model_fields.items():
        key = field.alias or name
        out[prefix + key] = field
        ann = field.annotation
        if isinstance(ann, type) and issubclass(ann, BaseModel):
            out.update(_model_keys(ann, prefix + key + "."))
    return out


ALL_KEYS = _model_keys(Config)
# keys whose value is a mapping of the user's own names (task.reward_kwargs.format_score=0.25)
OPEN_KEYS = tuple(k for k, f in ALL_KEYS.items() if typing.get_origin(f.annotation) is dict or f.annotation is dict)


def _known(key: str) -> bool:
    return key in ALL_KEYS or any(key.startswith(k + ".") for k in OPEN_KEYS)


def _unknown_key_error(key: str, source: str) -> ConfigError:
    foreign = foreign_hint(key)  # verl's or NeMo-RL's key: where it lives here, not a look-alike
    if foreign:
        return ConfigError(f"unknown config key '{key}' ({source}){foreign}")
    # suggest a sibling first (loss_fn.ratio_clip_mx -> loss_fn.ratio_clip_max), then any key
    section = key.rsplit(".", 1)[0] + "." if "." in key else ""
    siblings = [k for k in ALL_KEYS if k.startswith(section) and k.count(".") == key.count(".")]
    match = difflib.get_close_matches(key, siblings, n=1, cutoff=0.6) or difflib.get_close_matches(
        key, list(ALL_KEYS), n=1, cutoff=0.6)
    hint = f"; did you mean '{match[0]}'?" if match else "; run `dataplane-rl config show` for the valid keys"
    return ConfigError(f"unknown config key '{key}' ({source}){hint}")


def _check_keys(tree: dict, source: str, prefix: str = "") -> None:
    for k, v in tree.items():
        key = f"{prefix}{k}"
        if not _known(key):
            raise _unknown_key_error(key, source)
        if isinstance(v, dict) and key not in OPEN_KEYS:
            _check_keys(v, source, key + ".")


def parse_override(text: str) -> tuple[str, Any]:
    """`key=value` -> (key, value), the value read as YAML 1.2's core schema reads a plain scalar (yaml_load.py):
    `true`/`false`, `null`, integers (`0o17`, `0x1F`), floats (`1e-6`, `.inf`), `[a, b]` and `{k: v}`; anything
    else (`no`, `0123:45`, `2024-01-01`, text YAML cannot parse) is the string as typed."""
    if "=" not in text:
        raise ConfigError(f"override '{text}' is not key=value; write e.g. data_plane.enabled=true")
    key, raw = text.split("=", 1)
    key = key.strip()
    if not key:
        raise ConfigError(f"override '{text}' has an empty key")
    try:
        value = load_yaml(raw) if raw.strip() else None
    except DuplicateKeyError as e:  # `k={a: 1, a: 2}`: refused as in a file, not kept as a string
        raise ConfigError(f"override '{text}': {e.problem}") from None
    except yaml.YAMLError:
        value = raw
    return key, value


def check_overrides(overrides: list[str]) -> None:
    """The `key=value` arguments of one command line set each key once: a key given twice, or a section given
    beside one of its keys (`grpo.async_grpo={}` with `grpo.async_grpo.enabled=true`), is a ConfigError naming
    both, as a key given twice in a YAML file is; the last one would otherwise win silently."""
    seen: dict[str, str] = {}
    for text in overrides:
        key, _ = parse_override(text)
        for other, earlier in seen.items():
            if other == key:
                raise ConfigError(f"override key '{key}' is given twice ('{earlier}' and '{text}'); keep one: the "
                                  "last would win silently")
            if key.startswith(other + ".") or other.startswith(key + "."):
                section, inner = sorted((key, other), key=len)
                raise ConfigError(f"overrides '{earlier}' and '{text}' overlap: '{inner}' is inside '{section}', so "
                                  f"one would silently undo the other; give '{section}' whole or its keys one by one")
        seen[key] = text


def apply_overrides(tree: dict, overrides: list[str]) -> dict:
    for text in overrides:
        key, value = parse_override(text)
        if not _known(key):
            raise _unknown_key_error(key, f"override '{text}'")
        node = tree
        parts = key.split(".")
        for part in parts[:-1]:
            if not isinstance(node.get(part), dict):
                node[part] = {}
            node = node[part]
        node[parts[-1]] = value
    return tree


def load_config(path: str | os.PathLike | None = None, overrides: list[str] | None = None) -> Config:
    """Load a YAML config (default: the embedded grpo_tiny.yaml), apply overrides, validate.

    Raises ConfigError naming the file or override, the key and the fix.
    """
    path = Path(path) if path is not None else default_config_path()
    if not path.is_file():
        raise ConfigError(f"config file '{path}' not found; pass an existing YAML file with --config")
    tree = load_yaml_mapping(path, ConfigError, "config file", "pass a YAML file with --config",
                             "a mapping of sections (grpo:, policy:, ...)", empty_ok=True)
    _check_keys(tree, f"in {path}")
    apply_overrides(tree, list(overrides or []))
    return validate_tree(tree, str(path), {parse_override(o)[0]: o for o in overrides or []})


def validate_tree(tree: dict, source: str = "<dict>", overrides: dict[str, str] | None = None) -> Config:
    """Config.model_validate with one ConfigError naming where each bad value came from: the override
    (`overrides`: key -> its `key=value` text) or else `source`."""
    overrides = overrides or {}
    try:
        return Config.model_validate(tree)
    except ValidationError as e:
        msgs, from_source = [], False
        for err in e.errors():
            loc = ".".join(str(x) for x in err["loc"])
            msg = err["msg"].removeprefix("Value error, ")
            got = err.get("input")
            if loc in overrides:  # the user typed this value: name the command line, not the file it overrode
                msgs.append(f"override '{overrides[loc]}': {msg}")
                continue
            from_source = True
            shown = f" (got {got!r})" if loc and not isinstance(got, dict) else ""
            msgs.append(f"{loc}: {msg}{shown}" if loc else msg)
        where = f" ({source}{' with the command-line overrides' if overrides else ''})" if from_source else ""
        raise ConfigError(f"invalid config{where}: " + "; ".join(msgs)) from None


def dump_config(cfg: Config) -> str:
    return dump_yaml(cfg.model_dump(mode="json", by_alias=True))


def config_reference() -> str:
    """A Markdown table of every key, its default and its doc, generated from the models."""
    rows = ["| key | default | description |", "| --- | --- | --- |"]
    defaults = Config().model_dump(mode="json", by_alias=True)
    for key, field in ALL_KEYS.items():
        ann = field.annotation
        if isinstance(ann, type) and issubclass(ann, BaseModel):
            continue
        node: Any = defaults
        for part in key.split("."):
            node = node[part]
        rows.append(f"| `{key}` | `{json.dumps(node)}` | {field.description or ''} |")
    return "\n".join(rows)
