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


def where_raised(e: BaseException, path: str | None) -> str:
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
            raise ConfigError(f"{key} '{spec}' cannot be imported: {type(e).__name__}: {e} ({where_raised(e, None)}); "
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
        raise ConfigError(f"{key} '{path}' failed to import: {type(e).__name__}: {e} ({where_raised(e, str(path))})") from None
    return module


def load_function(spec: str, key: str = "task.reward_function"):
    """`WHERE:NAME` (as TaskConfig normalises it) -> the callable NAME of module or file WHERE."""
    where, _, name = spec.rpartition(":")
    fn = getattr(import_user_module(where, key), name, None)
    if not callable(fn):
        raise ConfigError(f"{key} '{spec}': {where} has no function '{name}'; define "
                          f"def {name}(data_source, solution_str, ground_truth, extra_info=None) there")
    return fn


# what verl's reward managers pass, by keyword: the naive manager per sample, the batch manager once with lists
ARGS = {"naive": ("data_source", "solution_str", "ground_truth", "extra_info"),
        "batch": ("data_sources", "solution_strs", "ground_truths", "extra_infos")}


def call_plan(fn, spec: str, manager: str, reward_kwargs: dict) -> tuple[tuple[str, ...], dict]:
    """(the verl arguments `fn` takes, the reward_kwargs it takes): verl calls by keyword, so a function may declare
    its parameters in any order and in any subset (verl's gsm8k scorer takes solution_str and ground_truth); one
    with **kwargs takes them all. A parameter nobody can give, a positional-only one, or a reward_kwargs key the
    function does not take is one ConfigError naming it, before the run starts."""
    import inspect

    try:
        params = inspect.signature(fn).parameters
    except (TypeError, ValueError):  # a builtin or C function without a signature: give it everything
        return ARGS[manager], dict(reward_kwargs)
    every = any(p.kind is p.VAR_KEYWORD for p in params.values())
    ours = ARGS[manager]
    for p in params.values():
        if p.kind is p.POSITIONAL_ONLY:
            raise ConfigError(f"task.reward_function {spec}: parameter '{p.name}' is positional-only; verl calls a "
                              f"reward function by keyword ({', '.join(ours)}): drop the '/' from its signature")
        if (p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY) and p.default is p.empty
                and p.name not in ours and p.name not in reward_kwargs):
            other = "naive" if manager == "batch" else "batch"
            hint = (f"; that is a {other} reward function's argument: set task.reward_manager={other}"
                    if p.name in ARGS[other] else f"; give it with task.reward_kwargs.{p.name}=VALUE or a default")
            raise ConfigError(f"task.reward_function {spec}: parameter '{p.name}' has no value: "
                              f"task.reward_manager={manager} passes {', '.join(ours)} and task.reward_kwargs{hint}")
    for k in reward_kwargs:
        if k in ours:
            raise ConfigError(f"task.reward_kwargs.{k}: '{k}' is what the reward manager passes; choose another name")
        if not every and k not in params:
            raise ConfigError(f"task.reward_kwargs.{k}: task.reward_function {spec} has no parameter '{k}' (its "
                              f"parameters: {', '.join(params)}); drop the key or add the parameter")
    return tuple(a for a in ours if every or a in params), dict(reward_kwargs)


class UserReward:
    """task.reward_function, called as verl calls it, its result checked: a float, or a dict with a float 'score'
    whose other keys are the sample's reward_extra_info. Every call gets its own copy of the row's values."""

    def __init__(self, spec: str, reward_kwargs: dict | None = None, manager: str = "naive") -> None:
        self.spec = spec
        self.fn = load_function(spec)
        self.args, self.kwargs = call_plan(self.fn, spec, manager, reward_kwargs or {})
        self.batched = manager == "batch"

    def _call(self, values: dict, where: str):
        import copy

        kwargs = {a: copy.deepcopy(values[a]) for a in self.args}  # no call sees another's (or the store's) objects
        kwargs.update(copy.deepcopy(self.kwargs))
        try:
            return self.fn(**kwargs)
        except BaseException as e:  # noqa: BLE001 - user code: KeyboardInterrupt and SystemExit too are its failure
            path = self.spec.rpartition(":")[0]
            at = where_raised(e, path) if _is_file(path) else where_raised(e, None)
            raise RewardFunctionError(f"task.reward_function {self.spec} raised {type(e).__name__}: "
                                      f"{' '.join(str(e).split())[:200]} ({at}) {where}; fix the function or the row") from None

    def score(self, data_source: str, solution_str: str, ground_truth, extra_info) -> tuple[float, dict]:
        """(the reward, the dict's other keys) of one sample."""
        got = self._call(dict(zip(ARGS["naive"], (data_source, solution_str, ground_truth, extra_info))),
                         f"for data_source {data_source!r} (response {solution_str[:40]!r})")
        return self.check(got, data_source, solution_str)

    def score_batch(self, sources: list, responses: list, truths: list, extras: list) -> list:
        """task.reward_manager=batch: one call with lists; each item (the reward, its extras) or the
        RewardFunctionError of that item alone."""
        got = self._call(dict(zip(ARGS["batch"], (sources, responses, truths, extras))),
                         f"on a batch of {len(responses)} samples")
        if isinstance(got, (str, bytes, dict)) or not hasattr(got, "__len__") or len(got) != len(responses):
            raise RewardFunctionError(f"task.reward_function {self.spec} (task.reward_manager=batch) returned "
                                      f"{_show(got) if not hasattr(got, '__len__') else f'{len(got)} items'} for "
                                      f"{len(responses)} samples; a batch reward function returns one score (or dict "
                                      "with 'score') per sample, in order")
        out = []
        for value, source, response in zip(got, sources, responses):
            try:
                out.append(self.check(value, source, response))
            except RewardFunctionError as e:
                out.append(e)
        return out

    def __call__(self, data_source: str, solution_str: str, ground_truth, extra_info) -> float:
        return self.score(data_source, solution_str, ground_truth, extra_info)[0]

    def check(self, got, data_source: str, solution_str: str) -> tuple[float, dict]:
        def fail(what: str) -> RewardFunctionError:
            return RewardFunctionError(f"task.reward_function {self.spec} {what} for data_source {data_source!r} "
                                       f"(response {solution_str[:40]!r}); a reward must be a finite number or a dict "
                                       "with a finite 'score'; fix the function or the row")

        if isinstance(got, dict) and "score" not in got:
            raise fail(f"returned a dict without 'score' (keys {sorted(map(str, got))[:6]})")
        number = finite_number(got.get("score") if isinstance(got, dict) else got, fail)
        extras = {str(k): v for k, v in got.items() if k != "score"} if isinstance(got, dict) else {}
        return number, extras


def is_bool(value) -> bool:
    """A bool of any kind: Python's, numpy's (np.bool_, a bool array) or torch's (a bool tensor)."""
    return isinstance(value, bool) or str(getattr(value, "dtype", "")) in ("bool", "torch.bool")


def finite_number(value, fail) -> float:
    """`value` as a finite float; else fail(what it was) raised. No bool of any kind is a number: True is not a
    score, whether Python's, numpy's or torch's (float() would take numpy's and torch's as 1.0)."""
    if is_bool(value):
        raise fail(f"returned {_show(value)} ({type(value).__name__}), a bool, which is not a score (return "
                   "float(...) for 1.0/0.0)")
    if not isinstance(value, (int, float)) and not hasattr(value, "__float__"):
        raise fail(f"returned {_show(value)} ({type(value).__name__})")
    try:
        number = float(value)
    except (TypeError, ValueError, OverflowError):
        raise fail(f"returned {_show(value)} ({type(value).__name__}), not a float") from None
    if not math.isfinite(number):
        raise fail(f"returned {number}")
    return number


def _show(value) -> str:
    try:
        text = json.dumps(value)
    except (TypeError, ValueError):
        text = repr(value)
    except RecursionError:
        text = type(value).__name__
    return text if len(text) <= 60 else text[:57] + "..."
