"""The user's code from files: task.module imported once per process, task.reward_function called with verl's signature."""

from __future__ import annotations

import hashlib
import importlib
import importlib.util
import json
import math
import sys
import traceback
from pathlib import Path

from dataplane_rl.errors import ConfigError, RewardFunctionError


def _is_file(spec: str) -> bool:
    from dataplane_rl.config.task import is_file_spec

    return is_file_spec(spec)


def _where(e: BaseException, path: str | None) -> str:
    """`FILE:LINE: source` of the deepest frame in `path` (else the deepest frame): the exception's line."""
    frames = traceback.extract_tb(e.__traceback__)
    if isinstance(e, SyntaxError) and e.filename:
        return f"{e.filename}:{e.lineno}: {(e.text or '').strip()}"
    mine = [f for f in frames if path and Path(f.filename).resolve() == Path(path).resolve()]
    f = (mine or frames or [None])[-1]
    return f"{f.filename}:{f.lineno}: {(f.line or '').strip()}" if f else "?"


def import_user_module(spec: str, key: str = "task.module"):
    """Import `spec` (FILE.py or a module name) once in this process and return the module. A file is imported
    under a name made from its path, so two files named alike do not collide and a second call is free.
    Any failure is one ConfigError naming the file and the line that raised."""
    if not _is_file(spec):
        try:
            return importlib.import_module(spec)
        except Exception as e:  # noqa: BLE001 - user code: any failure becomes the one-line error
            raise ConfigError(f"{key} '{spec}' cannot be imported: {type(e).__name__}: {e} ({_where(e, None)}); "
                              "give a FILE.py or a module on PYTHONPATH") from None
    path = Path(spec).resolve()
    name = f"dataplane_rl_user_{path.stem}_{hashlib.blake2b(str(path).encode(), digest_size=4).hexdigest()}"
    if name in sys.modules:
        return sys.modules[name]
    if not path.is_file():
        raise ConfigError(f"{key} '{spec}' is not a file; give the path of a Python file (relative to where the run "
                          "starts, or absolute) or an importable module name")
    module_spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(module_spec)
    sys.modules[name] = module  # before exec: dataclasses and pickling look the module up by name
    try:
        module_spec.loader.exec_module(module)
    except BaseException as e:  # noqa: BLE001 - SystemExit too: an import must not end the run silently
        del sys.modules[name]
        if isinstance(e, KeyboardInterrupt):
            raise
        raise ConfigError(f"{key} '{path}' failed to import: {type(e).__name__}: {e} ({_where(e, str(path))})") from None
    return module


def load_function(spec: str, key: str = "task.reward_function"):
    """`WHERE:NAME` (as TaskConfig normalises it) -> the callable NAME of module or file WHERE."""
    where, _, name = spec.rpartition(":")
    fn = getattr(import_user_module(where, key), name, None)
    if not callable(fn):
        raise ConfigError(f"{key} '{spec}': {where} has no function '{name}'; define "
                          f"def {name}(data_source, solution_str, ground_truth, extra_info=None) there")
    return fn


class UserReward:
    """task.reward_function, called as verl calls it, its result checked: a float, or a dict with a float 'score'."""

    def __init__(self, spec: str) -> None:
        self.spec = spec
        self.fn = load_function(spec)

    def __call__(self, data_source: str, solution_str: str, ground_truth, extra_info: dict | None) -> float:
        def fail(what: str) -> RewardFunctionError:
            return RewardFunctionError(f"task.reward_function {self.spec} {what} for data_source {data_source!r} "
                                       f"(response {solution_str[:40]!r}); a reward must be a finite number or a dict "
                                       "with a finite 'score'; fix the function or the row")

        try:
            got = self.fn(data_source, solution_str, ground_truth, extra_info)
        except Exception as e:  # noqa: BLE001 - user code: any failure is this row's data failure
            where = _where(e, self.spec.rpartition(":")[0]) if _is_file(self.spec.rpartition(":")[0]) else _where(e, None)
            raise fail(f"raised {type(e).__name__}: {' '.join(str(e).split())} ({where})") from None
        value = got.get("score") if isinstance(got, dict) else got
        if isinstance(got, dict) and "score" not in got:
            raise fail(f"returned a dict without 'score' (keys {sorted(map(str, got))[:6]})")
        if isinstance(value, bool) or not isinstance(value, (int, float)) and not hasattr(value, "__float__"):
            raise fail(f"returned {_show(value)} ({type(value).__name__})")
        try:
            number = float(value)
        except (TypeError, ValueError):
            raise fail(f"returned {_show(value)} ({type(value).__name__})") from None
        if not math.isfinite(number):
            raise fail(f"returned {number}")
        return number


def _show(value) -> str:
    try:
        return json.dumps(value)[:60]
    except (TypeError, ValueError):
        return repr(value)[:60]
