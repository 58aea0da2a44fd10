"""The declared column schema: typed objects loaded from schema/*.yaml, Arrow types, batch validation.

`schema/grpo.yaml` is the single source of truth. `DP_TRAIN_FIELDS` and the alias map are read from it.
"""

from __future__ import annotations

import difflib
import functools
import math
import os
import re
from functools import cached_property
from pathlib import Path
from typing import Annotated, Iterable, Literal, Mapping, Sequence

import numpy as np
import pyarrow as pa
from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, ValidationError, model_validator

from dataplane_rl.errors import SchemaError
from dataplane_rl.resources import data_dir
from dataplane_rl.schema.types import ARROW_DTYPES, inner_shape, nested_type, token_lengths, type_name, whole_dims
from dataplane_rl.schema.violations import Violation, bad_values
from dataplane_rl.yaml_load import load_yaml_mapping

WRITERS = ("rollout", "driver", "policy", "reference", "teacher")
MAX_INNER_VALUES = 1 << 20  # values one token of a shaped column may hold (prod(shape)): a typo, not data, past it


def _closest(word: str, choices: Iterable[str]) -> str:
    match = difflib.get_close_matches(word, list(choices), n=1)
    return f" (did you mean '{match[0]}'?)" if match else ""


# Schema, column, field-set and alias names; fullmatch only (a `$` anchor lets a trailing newline through).
NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_.-]{0,127}")
NAME_RULE = "1-128 letters, digits, '_', '.', '-', starting with a letter or '_'"


def _check_name(what: str, name: str) -> None:
    if not NAME.fullmatch(name):
        raise ValueError(f"{what} name {name!r} is invalid; use {NAME_RULE}")


class Column(BaseModel):
    """One declared column."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    name: str
    dtype: str = Field(description="Arrow type name of one value")
    kind: Literal["token", "sample"] = Field(description="token: one value per token; sample: one per row")
    writer: Literal["rollout", "driver", "policy", "reference", "teacher"]
    shape: Annotated[tuple[int | str, ...], BeforeValidator(whole_dims)] = Field(
        (), description="token columns only: the fixed inner shape each token holds (e.g. [64]); a row is [L, *shape]. "
                        "A dimension may name a config value (shape: [distillation.topk_logits_k]), which the run's "
                        "config fills in when the schema is bound to it (Schema.bind)")
    doc: str = ""
    allow_nonfinite: bool = Field(False, description="float columns only: NaN and +-inf are valid values "
                                                      "(refused by default, like nulls)")

    @model_validator(mode="after")
    def _check_dtype(self) -> "Column":
        _check_name("column", self.name)
        if self.dtype not in ARROW_DTYPES:
            raise ValueError(
                f"column '{self.name}' has unknown dtype '{self.dtype}'{_closest(self.dtype, ARROW_DTYPES)}; "
                f"use one of {', '.join(ARROW_DTYPES)}"
            )
        if self.kind == "token" and self.dtype == "string":
            raise ValueError(f"column '{self.name}': a token column cannot be a string; use an integer or float dtype")
        if self.shape:
            if self.kind != "token":
                raise ValueError(f"column '{self.name}': shape applies to token columns, not {self.kind} columns")
            dims = [d for d in self.shape if isinstance(d, int)]  # a named dimension is checked once bound
            if any(d < 1 for d in dims) or math.prod(dims) > MAX_INNER_VALUES:
                raise ValueError(f"column '{self.name}': shape {list(self.shape)} must list dimensions >= 1 holding "
                                 f"at most {MAX_INNER_VALUES} values per token")
        if self.allow_nonfinite and not self.dtype.startswith("float"):
            raise ValueError(f"column '{self.name}': allow_nonfinite applies to float columns, not {self.dtype}")
        return self

    @property
    def value_type(self) -> pa.DataType:
        return ARROW_DTYPES[self.dtype]

    @property
    def bound(self) -> bool:
        """False while a shape dimension names a config value: the column has no Arrow type until bound."""
        return all(isinstance(d, int) for d in self.shape)

    @property
    def token_type(self) -> pa.DataType:
        """What one token holds: dtype, or for a shaped column fixed_size_list<dtype, K> per inner dimension
        (shape [a, b]: fixed_size_list<fixed_size_list<dtype, b>, a>)."""
        if not self.bound:
            raise SchemaError(f"column '{self.name}' has shape {self.shape_text}, which names a config value: use the "
                              "schema bound to a config (Config.run_schema(), or schema.bind(config))")
        return nested_type(self.value_type, self.shape)

    @property
    def arrow_type(self) -> pa.DataType:
        """The stored Arrow type: list<token_type> for token columns, dtype for sample columns."""
        return pa.list_(self.token_type) if self.kind == "token" else self.value_type

    @property
    def shape_text(self) -> str:
        """'' for a scalar per token, else the shape as the schema file writes it: [64], [48, 8]."""
        return f"[{', '.join(map(str, self.shape))}]" if self.shape else ""


class Schema(BaseModel):
    """A declared set of columns, named field sets and aliases."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    name: str
    version: int = 1
    length_column: str = "input_lengths"
    columns: tuple[Column, ...]
    field_sets: dict[str, tuple[str, ...]] = {}
    aliases: dict[str, str] = {}
    source: str = Field(default="<memory>", exclude=True, description="file the schema was loaded from")

    @model_validator(mode="after")
    def _check_references(self) -> "Schema":
        _check_name("schema", self.name)
        for name in (*self.field_sets, *self.aliases.values()):
            _check_name("field set or alias", name)
        seen: set[str] = set()
        for col in self.columns:
            if col.name in seen:
                raise ValueError(f"duplicate column '{col.name}'; each column is declared once")
            seen.add(col.name)
        length = next((c for c in self.columns if c.name == self.length_column), None)
        has_tokens = any(c.kind == "token" for c in self.columns)
        if has_tokens and (length is None or length.kind != "sample" or not length.dtype.startswith("int")):
            raise ValueError(
                f"length_column '{self.length_column}' must be a declared integer sample column "
                "when the schema has token columns"
            )
        for set_name, fields in self.field_sets.items():
            for f in fields:
                if f not in seen:
                    raise ValueError(
                        f"field set '{set_name}' names undeclared column '{f}'{_closest(f, seen)}; "
                        "declare it under columns or remove it from the set"
                    )
            if len(set(fields)) != len(fields):
                raise ValueError(f"field set '{set_name}' lists a column twice")
        for storage, alias in self.aliases.items():
            if storage not in seen:
                raise ValueError(
                    f"alias '{storage}: {alias}' names undeclared column '{storage}'{_closest(storage, seen)}"
                )
            if alias in seen:
                raise ValueError(f"alias '{storage}: {alias}' shadows the declared column '{alias}'")
        return self

    # ---- lookups ------------------------------------------------------------------------------
    @cached_property
    def by_name(self) -> dict[str, Column]:
        return {c.name: c for c in self.columns}

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(c.name for c in self.columns)

    @property
    def bound(self) -> bool:
        """True when no shape names a config value (see `bind`)."""
        return all(c.bound for c in self.columns)

    def bind(self, config) -> "Schema":
        """This schema with each shape dimension that names a config value (distillation.topk_logits_k) replaced by
        that value in `config` (a run's Config, or an object or mapping with those keys); itself if none does."""
        from dataplane_rl.schema.binding import bind

        return bind(self, config)

    @cached_property
    def bindings(self) -> dict:
        """The schemas `bind` made from this one, by their values: a config validation, a run and a store bind often."""
        return {}

    @cached_property
    def json_text(self) -> str:
        """model_dump_json(), made once (a partition records its schema's JSON at every create)."""
        return self.model_dump_json()

    def column(self, name: str) -> Column:
        try:
            return self.by_name[name]
        except KeyError:
            raise SchemaError(
                f"schema '{self.name}' has no column '{name}'{_closest(name, self.by_name)}; "
                f"declared columns: {', '.join(self.names)}"
            ) from None

    def field_set(self, name: str) -> tuple[str, ...]:
        try:
            return self.field_sets[name]
        except KeyError:
            raise SchemaError(
                f"schema '{self.name}' has no field set '{name}'{_closest(name, self.field_sets)}; "
                f"field sets: {', '.join(self.field_sets)}"
            ) from None

    def require_shape(self, name: str, shape: Sequence[int], because: str) -> None:
        """Raise SchemaError unless token column `name` holds `shape` per token. A run calls it on its bound
        schema before it starts, with `because` the setting that wants that shape ('distillation.topk_logits_k=32'):
        a shape that names the setting always holds; one a schema file writes as a number must equal it."""
        col = self.column(name)
        want = tuple(int(d) for d in shape)
        if col.kind != "token" or col.shape != want:
            has = col.shape_text or "none (one value per token)" if col.kind == "token" else f"none ({col.kind} column)"
            raise SchemaError(
                f"schema '{self.name}' ({self.source}) column '{name}' has shape {has}, but {because} needs "
                f"shape [{', '.join(map(str, want))}]; change that setting to match, or pass a schema file "
                f"declaring '{name}' with shape: [{', '.join(map(str, want))}] as data_plane.schema"
            )

    def sets_of(self, column: str) -> list[str]:
        return [s for s, fields in self.field_sets.items() if column in fields]

    def arrow_schema(self, fields: Sequence[str] | None = None) -> pa.Schema:
        """The Arrow schema of `fields` (all columns by default), in the given order."""
        fields = self.names if fields is None else fields
        return pa.schema([pa.field(f, self.column(f).arrow_type, nullable=False) for f in fields])

    def apply_aliases(self, batch: Mapping[str, object]) -> dict[str, object]:
        """Rename storage names to the names the loss sees (total_reward -> rewards)."""
        return {self.aliases.get(k, k): v for k, v in batch.items()}

    def storage_name(self, loss_name: str) -> str:
        """The stored column behind a loss-side name ('rewards' -> 'total_reward')."""
        for storage, alias in self.aliases.items():
            if alias == loss_name:
                return storage
        return loss_name

    # ---- validation ---------------------------------------------------------------------------
    def violations(
        self,
        batch: Mapping[str, pa.Array | pa.ChunkedArray] | pa.Table,
        lengths: np.ndarray | None = None,
    ) -> list[Violation]:
        """Every way `batch` breaks the schema: unknown columns, dtypes, row counts, token lengths.

        `lengths` gives the per-row token counts when the batch itself has no length column (e.g. a
        put of prev_logprobs checked against input_lengths already in the store).
        """
        if isinstance(batch, pa.Table):
            batch = {name: batch.column(name) for name in batch.column_names}
        out: list[Violation] = []
        counts = {name: len(arr) for name, arr in batch.items()}
        for name, arr in batch.items():
            if name not in self.by_name:
                out.append(Violation(name, f"not declared in schema '{self.name}'{_closest(name, self.by_name)}; "
                                           "declare it in the schema file or drop it"))
                continue
            col = self.by_name[name]
            if arr.type != col.arrow_type:
                shape = f", shape {col.shape_text} per token" if col.shape else ""
                out.append(Violation(name, f"has type {type_name(arr.type)}, declared {type_name(col.arrow_type)} "
                                           f"(dtype {col.dtype}, kind {col.kind}{shape}); cast it before writing"))
            elif arr.null_count:
                nulls = np.flatnonzero(np.asarray(arr.is_null()))
                out.append(Violation(name, "has null values; every cell must hold a value", tuple(nulls.tolist())))
            else:
                out.extend(bad_values(col, arr))
        if len(set(counts.values())) > 1:
            desc = ", ".join(f"{k}={v}" for k, v in counts.items())
            out.append(Violation("*", f"columns have different row counts ({desc}); every column must cover the same rows"))
            return out
        if lengths is None and self.length_column in batch:
            arr = batch[self.length_column]
            if arr.type == self.by_name[self.length_column].arrow_type and not arr.null_count:
                lengths = np.asarray(arr.to_numpy(zero_copy_only=False), dtype=np.int64)
        if lengths is not None:
            bad = np.flatnonzero(lengths < 0)
            if bad.size:
                out.append(Violation(self.length_column, "negative length", tuple(bad.tolist())))
        for name, arr in batch.items():
            col = self.by_name.get(name)
            if col is None or col.kind != "token" or arr.type != col.arrow_type:
                continue
            if lengths is None:
                out.append(Violation(name, f"token column written without '{self.length_column}'; "
                                           f"write {self.length_column} first or in the same put"))
                continue
            got = token_lengths(arr)
            if len(got) == len(lengths):
                bad = np.flatnonzero(got != lengths)
                if bad.size:
                    r = int(bad[0])
                    out.append(Violation(name, f"token lengths differ from {self.length_column} "
                                               f"(the first has {int(got[r])} tokens, {self.length_column}={int(lengths[r])})",
                                         tuple(bad.tolist())))
        return out

    def check(self, batch, lengths: np.ndarray | None = None, *, where: str = "", rows: np.ndarray | None = None) -> None:
        """Raise SchemaError listing every violation of `batch` (see `violations`). `rows`: the partition row
        of each batch position, so the error names the rows as the caller knows them."""
        found = self.violations(batch, lengths)
        if rows is not None:
            found = [Violation(v.column, v.message, tuple(int(rows[i]) for i in v.rows)) for v in found]
        if found:
            from dataplane_rl.errors import AlignmentError

            prefix = f"{where}: " if where else ""
            detail = "; ".join(str(v) for v in found[:8]) + (f"; ... {len(found) - 8} more" if len(found) > 8 else "")
            cls = AlignmentError if any(v.column == "*" for v in found) else SchemaError
            raise cls(f"{prefix}{detail}")


def schema_path(name_or_path: str | Path) -> Path:
    """Resolve a schema name ('grpo') or a file path to a file, with a clear error if missing."""
    p = Path(name_or_path)
    if p.suffix in (".yaml", ".yml") or p.exists() or "/" in str(name_or_path):
        if not p.is_file():
            raise SchemaError(f"schema file '{p}' not found; pass an existing YAML file or a built-in name "
                              f"({', '.join(available_schemas())})")
        return p
    candidate = data_dir("schema") / f"{name_or_path}.yaml"
    if not candidate.is_file():
        raise SchemaError(f"no built-in schema '{name_or_path}'{_closest(str(name_or_path), available_schemas())}; "
                          f"built-in: {', '.join(available_schemas())}, or pass a path to a YAML file")
    return candidate


def available_schemas() -> list[str]:
    return sorted(p.stem for p in data_dir("schema").glob("*.yaml"))


def load_schema(name_or_path: str | Path = "grpo") -> Schema:
    """Load and validate a schema by built-in name or path. Errors name the file and the fix."""
    if isinstance(name_or_path, Schema):
        return name_or_path
    if isinstance(name_or_path, str) and name_or_path in _BUILTIN_PATHS and not os.path.exists(name_or_path):
        # a built-in name seen before (and no file of that name here): two stats, no path resolution
        path_text = _BUILTIN_PATHS[name_or_path]
        try:
            return _load_file(path_text, os.stat(path_text).st_mtime_ns)
        except FileNotFoundError:
            _BUILTIN_PATHS.pop(name_or_path, None)
    path = schema_path(name_or_path)
    path_text = str(path.resolve())
    if isinstance(name_or_path, str) and Path(name_or_path).suffix == "" and "/" not in name_or_path \
            and not Path(name_or_path).exists():
        _BUILTIN_PATHS[name_or_path] = path_text
    # parsing YAML costs ~40 ms; partitions are created every step, so cache by file and mtime
    return _load_file(path_text, path.stat().st_mtime_ns)


_BUILTIN_PATHS: dict[str, str] = {}  # built-in schema name -> its resolved file (create_partition runs every step)


@functools.lru_cache(maxsize=64)
def _load_file(path_text: str, mtime_ns: int) -> Schema:
    path = Path(path_text)
    raw = load_yaml_mapping(path, SchemaError, "schema file", "pass a YAML schema file",
                            "a mapping with 'name' and 'columns'")
    try:
        return Schema(**raw, source=str(path))
    except ValidationError as e:
        msgs = []
        for err in e.errors():
            loc = ".".join(str(x) for x in err["loc"])
            msg = err["msg"].removeprefix("Value error, ")
            msgs.append(f"{loc}: {msg}" if loc else msg)
        raise SchemaError(f"schema file '{path}': " + "; ".join(msgs)) from None
    except TypeError as e:
        raise SchemaError(f"schema file '{path}': {e}") from None


GRPO_SCHEMA: Schema = load_schema("grpo")
DP_TRAIN_FIELDS: tuple[str, ...] = GRPO_SCHEMA.field_set("DP_TRAIN_FIELDS")
LOGPROB_SEED_FIELDS: tuple[str, ...] = GRPO_SCHEMA.field_set("LOGPROB_SEED_FIELDS")
DRIVER_FIELDS: tuple[str, ...] = GRPO_SCHEMA.field_set("DRIVER_FIELDS")
ALIASES: dict[str, str] = dict(GRPO_SCHEMA.aliases)


def apply_aliases(batch: Mapping[str, object], schema: Schema = GRPO_SCHEMA) -> dict[str, object]:
    """Rename storage names to loss names using `schema`'s alias map."""
    return schema.apply_aliases(batch)


__all__ = [
    "ALIASES", "ARROW_DTYPES", "Column", "DP_TRAIN_FIELDS", "DRIVER_FIELDS", "GRPO_SCHEMA",
    "LOGPROB_SEED_FIELDS", "Schema", "Violation", "apply_aliases", "available_schemas", "inner_shape",
    "load_schema", "nested_type", "token_lengths",
]
