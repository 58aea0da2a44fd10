"""verl's data and reward functions as verl users have them (docs/tasks.md, "From verl"): rows as identities, reward
functions called by keyword with reward_kwargs, batched, returning extras, prompt length limits, and the task's and
reward's failures as one line naming them. Through the real rollout worker and the tiny model where a row is made."""

from __future__ import annotations

import json
import math
import os
import textwrap
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from dataplane_rl.config import load_config
from dataplane_rl.errors import ConfigError, RewardFunctionError
from dataplane_rl.model.load import build_tiny, load_tokenizer
from dataplane_rl.rollout.worker import RolloutJob, RolloutWorker
from dataplane_rl.tasks import TASKS, load_task, register_task
from dataplane_rl.tasks.dataset import DatasetTask
from dataplane_rl.tasks.prompts import PromptSampler, encode_prompt, truncate
from dataplane_rl.tasks.user_code import UserReward

SMALL = ["grpo.num_generations_per_prompt=2", "generation.max_new_tokens=4"]


def verl_file(path: Path, prompts: list[str], truths: list[str], source: str = "openai/gsm8k") -> str:
    """A Parquet file in verl's layout, one row per (prompt, ground truth), each with its own extra_info.index."""
    pq.write_table(pa.Table.from_pylist([
        {"data_source": source, "prompt": [{"role": "user", "content": p}], "ability": "math",
         "reward_model": {"style": "rule", "ground_truth": g}, "extra_info": {"split": "train", "index": i}}
        for i, (p, g) in enumerate(zip(prompts, truths))]), path)
    return str(path)


def reward_file(tmp_path: Path, body: str, name: str = "r.py") -> str:
    (tmp_path / name).write_text(textwrap.dedent(body))
    return str(tmp_path / name)


def worker(*overrides: str) -> RolloutWorker:
    cfg = load_config(None, [*SMALL, *overrides])
    return RolloutWorker(cfg.model_dump(mode="json", by_alias=True), str(build_tiny(cfg.grpo.seed)), None, 1)


def generate(w: RolloutWorker, keys: list) -> tuple[list[dict], dict]:
    table, receipt = w.generate(RolloutJob("step-000001", 1, 0, 0, list(range(len(keys))), keys))
    return table.to_pylist(), receipt


@pytest.fixture(scope="module")
def data(tmp_path_factory) -> str:
    """8 rows: one prompt twice with two ground truths (rows 0 and 1), one prompt three times (rows 2-4)."""
    d = tmp_path_factory.mktemp("verl")
    return verl_file(d / "train.parquet", ["what is 1+1?", "what is 1+1?", "what is 2+2?", "what is 2+2?",
                                           "what is 2+2?", "what is 3+3?", "what is 4+4?", "what is 5+5?"],
                     ["2", "two", "4", "4", "4", "6", "8", "10"])


def test_a_verl_signature_in_any_order_gets_each_sample_by_keyword(data, tmp_path):
    """verl's docs' order, compute_score(solution_str, ground_truth, data_source=None, extra_info=None, **kwargs),
    called by position gave solution_str='openai/gsm8k' to every sample: by keyword, each gets its own response,
    its own row's ground truth and extra_info, and task.reward_kwargs."""
    fn = reward_file(tmp_path, """
        def compute_score(solution_str, ground_truth, data_source=None, extra_info=None, **kwargs):
            return {"score": len(solution_str) / 100 + kwargs["bonus"], "gt": ground_truth,
                    "index": extra_info["index"], "source": data_source}
    """)
    w = worker("task.name=dataset", f"task.path={data}", f"task.val_path={data}", f"task.reward_function={fn}",
               "task.reward_kwargs.bonus=0.5")
    rows, _ = generate(w, [0, 1, 3, 4])  # duplicate prompts, rows with their own ground truths
    assert [r["dataset_row"] for r in rows] == [0, 0, 1, 1, 3, 3, 4, 4]
    truths = ["2", "two", "4", "4"]
    for r in rows:
        want = len(r["response_text"]) / 100 + 0.5
        assert r["total_reward"] == np.float32(want) and r["total_reward"] != np.float32(len("openai/gsm8k") / 100 + 0.5)
        extra = json.loads(r["reward_extra_info"])
        assert extra == {"gt": truths[[0, 1, 3, 4].index(r["dataset_row"])], "index": r["dataset_row"],
                         "source": "openai/gsm8k"}
        assert r["ground_truth"] == extra["gt"] and json.loads(r["extra_info"])["index"] == r["dataset_row"]


def test_only_the_declared_parameters_are_passed_so_verls_gsm8k_scorer_runs_unchanged(tmp_path):
    """verl's gsm8k.py: compute_score(solution_str, ground_truth, method='strict', format_score=0.0, score=1.0):
    no data_source, no extra_info; reward_kwargs reach the parameters it declares."""
    fn = reward_file(tmp_path, """
        def compute_score(solution_str, ground_truth, method="strict", format_score=0.0, score=1.0):
            return score if solution_str.strip() == ground_truth else format_score
    """)
    r = UserReward(f"{fn}:compute_score", {"format_score": 0.25})
    assert r("openai/gsm8k", "42", "42", {"i": 1}) == 1.0 and r("openai/gsm8k", "41", "42", None) == 0.25
    assert r.args == ("solution_str", "ground_truth")


@pytest.mark.parametrize("body, kwargs, manager, what", [
    ("def compute_score(solution, ground_truth): return 0.0", {}, "naive",
     r"parameter 'solution' has no value: task.reward_manager=naive passes data_source, solution_str, ground_truth, "
     r"extra_info and task.reward_kwargs; give it with task.reward_kwargs.solution=VALUE or a default"),
    ("def compute_score(data_sources, solution_strs, ground_truths, extra_infos): return []", {}, "naive",
     r"parameter 'data_sources' has no value: .* a batch reward function's argument: set task.reward_manager=batch"),
    ("def compute_score(solution_str, ground_truth, format_score=0.0): return 0.0", {"format_scor": 0.1}, "naive",
     r"task.reward_kwargs.format_scor: task.reward_function .* has no parameter 'format_scor' \(its parameters: "
     r"solution_str, ground_truth, format_score\)"),
    ("def compute_score(solution_str, /, ground_truth): return 0.0", {}, "naive", r"parameter 'solution_str' is positional-only"),
    ("def compute_score(solution_str, ground_truth): return 0.0", {"solution_str": 1}, "naive",
     r"task.reward_kwargs.solution_str: 'solution_str' is what the reward manager passes"),
])
def test_a_signature_that_cannot_be_called_is_one_line_naming_the_parameter(tmp_path, body, kwargs, manager, what):
    fn = reward_file(tmp_path, body)
    with pytest.raises(ConfigError, match=what):
        UserReward(f"{fn}:compute_score", kwargs, manager)


def test_the_signature_is_checked_before_ray_starts(tmp_path, capsys):
    from dataplane_rl.cli.main import main

    fn = reward_file(tmp_path, "def compute_score(solution_str, answer):\n    return 0.0\n")
    rc = main(["train", f"task.reward_function={fn}", f"logger.run_dir={tmp_path / 'never'}"])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and len(err) == 1 and "parameter 'answer' has no value" in err[0] and err[0].startswith("error: ")


def test_the_batch_manager_calls_once_with_lists_and_fails_only_the_bad_items_groups(data, tmp_path):
    fn = reward_file(tmp_path, """
        CALLS = []
        def compute_score(data_sources, solution_strs, ground_truths, extra_infos, weight=1.0):
            CALLS.append(len(solution_strs))
            return [float("nan") if e["index"] == 5 else {"score": weight * len(s), "n": len(s)}
                    for s, e in zip(solution_strs, extra_infos)]
    """)
    w = worker("task.name=dataset", f"task.path={data}", f"task.val_path={data}", f"task.reward_function={fn}",
               "task.reward_manager=batch", "task.reward_kwargs.weight=2.0")
    rows, receipt = generate(w, [2, 5, 6])
    from dataplane_rl.tasks.user_code import import_user_module

    module = import_user_module(fn)  # the worker's module: it ran in this process
    assert module.CALLS == [6], "one call with the job's 6 samples"
    assert [g for g, reason, _ in receipt["failed_groups"]] == [1] and "returned nan" in receipt["failed_groups"][0][2]
    naive = reward_file(tmp_path, "def compute_score(solution_str, ground_truth):\n    return float('inf')\n", "inf.py")
    _, receipt = generate(worker("task.name=dataset", f"task.path={data}", f"task.val_path={data}",
                                 f"task.reward_function={naive}"), [4])
    assert receipt["failed_groups"][0][2].endswith(f"[task path '{data}' row 4]")  # the row it scored
    assert [r["dataset_row"] for r in rows] == [2, 2, 6, 6]  # group 1 (row 5) is never stored
    for r in rows:
        assert r["total_reward"] == 2.0 * len(r["response_text"]) and json.loads(r["reward_extra_info"]) == {"n": len(r["response_text"])}
    bad = reward_file(tmp_path, "def compute_score(data_sources, solution_strs, ground_truths, extra_infos):\n"
                                "    return [1.0]\n", "short.py")
    w = worker("task.name=dataset", f"task.path={data}", f"task.val_path={data}", f"task.reward_function={bad}",
               "task.reward_manager=batch")
    rows, receipt = generate(w, [2, 5])
    assert rows == [] and sorted(g for g, _, _ in receipt["failed_groups"]) == [0, 1]
    assert "returned 1 items for 4 samples" in receipt["failed_groups"][0][2]


def test_a_reward_that_mutates_its_inputs_changes_no_other_call_and_no_stored_column(data, tmp_path):
    """Each call gets its own copy of extra_info and ground_truth: the samples of one prompt share nothing."""
    fn = reward_file(tmp_path, """
        def compute_score(data_source, solution_str, ground_truth, extra_info=None):
            extra_info["calls"] = extra_info.get("calls", 0) + 1
            extra_info["split"] = "mutated"
            return float(extra_info["calls"])
    """)
    w = worker("task.name=dataset", f"task.path={data}", f"task.val_path={data}", f"task.reward_function={fn}")
    rows, _ = generate(w, [2, 2])
    assert {r["total_reward"] for r in rows} == {1.0}
    assert {r["extra_info"] for r in rows} == {json.dumps({"index": 2, "split": "train"}, sort_keys=True)}


def jsonl(path: Path, rows: list[dict]) -> str:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def test_row_values_reach_the_reward_exactly_as_written(tmp_path):
    """Arrow types a column as one: JSONL ground truths 1 and 2.5 became 1.0 and 2.5, rows' extra_info dicts got each
    other's keys as null, a list of mixed types was refused as missing; a folder's files were promoted alike. A
    Parquet MAP arrived as a list of pairs and a pandas categorical prompt was refused. Each reaches the reward as it
    was written, and is stored so."""
    import pandas as pd

    from dataplane_rl.tasks import prompt_row

    fn = reward_file(tmp_path, """
        def compute_score(data_source, solution_str, ground_truth, extra_info=None):
            return {"score": 0.0, "gt": [ground_truth, type(ground_truth).__name__], "extra": extra_info}
    """)
    rows = [{"prompt": "p0", "reward_model": {"ground_truth": 1}, "extra_info": {"x": 1}},
            {"prompt": "p1", "reward_model": {"ground_truth": 2.5}, "extra_info": {"y": "q"}},
            {"prompt": "p2", "reward_model": {"ground_truth": [1, "x"]}, "extra_info": {"x": 2.0, "z": [1]}}]
    for folder, files in (("two", 2), ("three", 3)):  # a file per row: Parquet's int 1, JSONL's float 2.5, the list
        (tmp_path / folder).mkdir()
        pq.write_table(pa.Table.from_pylist(rows[:1]), tmp_path / folder / "a.parquet")
        for i in range(1, files):
            jsonl(tmp_path / folder / f"{'abc'[i]}.jsonl", rows[i:i + 1])
    for path, n in ((jsonl(tmp_path / "d.jsonl", rows), 3), (str(tmp_path / "two"), 2), (str(tmp_path / "three"), 3)):
        task = load_task(load_config(None, ["task.name=dataset", f"task.path={path}", f"task.val_path={path}",
                                            f"task.reward_function={fn}"]).task)
        for k, r in enumerate(rows[:n]):
            gt, extra = r["reward_model"]["ground_truth"], r["extra_info"]
            got = task.score(k, "42")[1]
            assert got == {"gt": [gt, type(gt).__name__], "extra": extra}, (path, k)
            assert [type(v) for v in got["extra"].values()] == [type(v) for v in extra.values()]
            stored = prompt_row(task, k)
            assert json.loads(stored.extra_json) == extra and stored.ground_truth_text == json.dumps(gt)
    # a Parquet MAP column is a dict; a dictionary-encoded (categorical) prompt column is text
    pd.DataFrame({"prompt": pd.Categorical(["what is 1+1?", "what is 2+2?", "what is 1+1?"]), "gt": ["2", "4", "2"]}
                 ).to_parquet(tmp_path / "cat.parquet")
    table = pq.read_table(tmp_path / "cat.parquet").append_column(
        "extra_info", pa.array([[("k", 1)], [("k", 2), ("j", 3)], []], pa.map_(pa.string(), pa.int64())))
    assert pa.types.is_dictionary(table.schema.field("prompt").type)
    pq.write_table(table, tmp_path / "cat.parquet")
    task = DatasetTask(str(tmp_path / "cat.parquet"), val_path=str(tmp_path / "cat.parquet"), output_key="gt")
    assert [task.text(k) for k in range(3)] == ["what is 1+1?", "what is 2+2?", "what is 1+1?"]
    assert [task.row(k).extra_info for k in range(3)] == [{"k": 1}, {"k": 2, "j": 3}, {}]


def test_stored_json_is_strict_and_a_rewards_numpy_and_torch_extras_are_logged(tmp_path):
    """NaN and the infinities have no JSON literal: the extra_info, ground_truth and reward_extra_info columns hold
    them as "NaN", "Infinity", "-Infinity" (bare NaN broke strict readers). A reward's numpy and torch values are
    stored as the numbers they hold (np.float32 was stored as the string "0.25" and its metric vanished)."""
    from dataplane_rl.driver.samples import reward_extras
    from dataplane_rl.rollout.retries import Retries, score_job
    from dataplane_rl.tasks.dataset import PromptRow

    def strict(text: str):
        return json.loads(text, parse_constant=lambda c: pytest.fail(f"{c} in stored JSON {text}"))

    row = PromptRow("s", [math.nan, math.inf], {"a": -math.inf, "b": np.float32(0.5), "c": {"d": math.nan}})
    assert strict(row.extra_json) == {"a": "-Infinity", "b": 0.5, "c": {"d": "NaN"}}
    assert strict(row.ground_truth_text) == ["NaN", "Infinity"]
    fn = reward_file(tmp_path, """
        import numpy as np
        import torch

        def compute_score(solution_str, ground_truth):
            return {"score": np.float32(0.5), "f32": np.float32(0.25), "i64": np.int64(3), "t": torch.tensor(1.5),
                    "ok": np.bool_(True), "tb": torch.tensor(False), "nan": float("nan"), "arr": np.arange(2)}
    """)
    data = jsonl(tmp_path / "d.jsonl", [{"prompt": "p", "reward_model": {"ground_truth": "1"}}])
    task = load_task(load_config(None, ["task.name=dataset", f"task.path={data}", f"task.val_path={data}",
                                        f"task.reward_function={fn}"]).task)
    rewards, extras = score_job(task, [0], [0], ["a", "b"], 2, Retries(0))
    assert rewards == [0.5, 0.5]
    for text in extras:
        assert strict(text) == {"f32": 0.25, "i64": 3, "t": 1.5, "ok": True, "tb": False, "nan": "NaN", "arr": [0, 1]}
    assert reward_extras(extras) == {"train/reward_extra/f32": 0.25, "train/reward_extra/i64": 3.0,
                                     "train/reward_extra/ok": 1.0, "train/reward_extra/t": 1.5,
                                     "train/reward_extra/tb": 0.0}


def test_a_rewards_print_goes_to_the_run_folder_not_stdout(data, tmp_path, capsys):
    """Ray carries a rollout actor's stdout to the CLI's stdout, whose one line is the run's summary (`| jq`): what a
    reward prints goes to RUN_DIR/rollout_stdout.log."""
    fn = reward_file(tmp_path, """
        def compute_score(solution_str, ground_truth):
            print("scoring", ground_truth)
            return 1.0
    """)
    (tmp_path / "run").mkdir()
    w = worker("task.name=dataset", f"task.path={data}", f"task.val_path={data}", f"task.reward_function={fn}",
               f"logger.run_dir={tmp_path / 'run'}")
    rows, _ = generate(w, [2, 5])
    assert len(rows) == 4 and capsys.readouterr().out == ""
    w.close()
    assert (tmp_path / "run" / "rollout_stdout.log").read_text() == "scoring 4\n" * 2 + "scoring 6\n" * 2


@pytest.mark.parametrize("body, what", [
    ("raise KeyboardInterrupt('stop')", r"raised KeyboardInterrupt: stop \(.*r\.py:3"),
    ("raise SystemExit(3)", r"raised SystemExit: 3 \(.*r\.py:3"),
    ("return 10 ** 400", r"returned 1000000000.*\.\.\. \(int\), not a float for data_source 'openai/gsm8k'"),
])
def test_any_failure_of_a_reward_is_a_data_failure_naming_the_function(tmp_path, body, what):
    fn = reward_file(tmp_path, f"def compute_score(data_source, solution_str, ground_truth, extra_info=None):\n"
                               f"    x = 1\n    {body}\n")
    with pytest.raises(RewardFunctionError, match=rf"task.reward_function .*r\.py:compute_score {what}"):
        UserReward(f"{fn}:compute_score")("openai/gsm8k", "42", "42", {})


TASK_MODULE = """
from dataplane_rl.tasks import register_task


class Mine:
    name = "mine"

    def __init__(self, mode):
        self.mode = mode

    def prompts(self, seed, step, round_, n):
        if self.mode == "raises":
            raise RuntimeError("no prompts today")
        if self.mode == "ints":
            return list(range(n))
        if self.mode == "short":
            return ["123"] * (n - 1)
        return ["123"] * n

    def val_prompts(self, n):
        return ["456"]

    def reward(self, prompt, response):
        return "high"


for mode in ("raises", "ints", "short", "string_reward"):
    register_task(mode, lambda path=None, mode=mode: Mine(mode))
register_task("with_val", lambda path=None, val_path=None: Mine(val_path))
"""


@pytest.fixture()
def mine(tmp_path):
    (tmp_path / "mine.py").write_text(TASK_MODULE)
    yield str(tmp_path / "mine.py")
    for name in ("raises", "ints", "short", "string_reward", "with_val"):
        TASKS.pop(name, None)


@pytest.mark.parametrize("mode, what", [
    ("raises", r"task 'mine' \(task.module .*mine\.py\) prompts\(0, 1, 0, 4\) raised RuntimeError: no prompts today "
               r"\(.*mine\.py:\d+: raise RuntimeError"),
    ("ints", r"task 'mine' \(task.module .*mine\.py\): prompts\(\) gave 0 \(int\); a prompt is non-empty text"),
    ("short", r"task 'mine' \(task.module .*mine\.py\) prompts\(0, 1, 0, 4\) returned 3 prompts; it must return a "
              r"list of 4 prompts"),
])
def test_a_tasks_bad_prompts_are_one_line_naming_the_task_and_method(mine, mode, what):
    cfg = load_config(None, [f"task.module={mine}", f"task.name={mode}"])
    tok = load_tokenizer(build_tiny(0))
    sampler = PromptSampler(cfg, load_task(cfg.task, tok), tok, str(build_tiny(0)))
    with pytest.raises(ConfigError, match=what):
        sampler.draw(0, 1, 0, 4)


def test_a_tasks_reward_of_the_wrong_type_fails_its_group_naming_the_task(mine):
    w = worker(f"task.module={mine}", "task.name=string_reward")
    rows, receipt = generate(w, ["123"])
    assert rows == [] and len(receipt["failed_groups"]) == 1
    assert "RewardFunctionError: task 'mine' (task.module " in receipt["failed_groups"][0][2]
    assert "reward() returned \"high\" (str) for prompt '123'" in receipt["failed_groups"][0][2]


def test_val_path_reaches_every_task_or_is_refused_by_name(mine, tmp_path):
    with pytest.raises(ConfigError, match=r"task.val_path is set, and task 'repeat' takes no val_path"):
        load_task(load_config(None, [f"task.val_path={tmp_path}"]).task)
    task = load_task(load_config(None, [f"task.module={mine}", "task.name=with_val", f"task.val_path={tmp_path}"]).task)
    assert task.mode == str(tmp_path)


def test_an_overlong_prompt_is_refused_by_row_filtered_and_counted_or_cut(tmp_path):
    """The tiny model has 256 positions; with 4 new tokens a prompt may hold 252 (task.max_prompt_length's default)."""
    long = "what is " + "1+" * 200 + "1?"
    data = verl_file(tmp_path / "d.parquet", ["what is 1+1?"] * 3 + [long] + ["what is 2+2?"] * 4, ["2"] * 3 + ["201"] + ["4"] * 4)
    tok = load_tokenizer(build_tiny(0))
    folder = str(build_tiny(0))
    base = ["task.name=dataset", f"task.path={data}", f"task.val_path={data}", "task.shuffle=false", *SMALL]

    def sampler(*extra):
        cfg = load_config(None, [*base, *extra])
        return PromptSampler(cfg, load_task(cfg.task, tok), tok, folder)

    assert sampler().limit == 256 - 4 and len(encode_prompt(tok, load_task(load_config(None, base).task, tok).text(3))) > 252
    with pytest.raises(ConfigError, match=rf"task path '{data}' row 3 \(step 1\): the prompt has \d+ tokens, more than "
                                          r"task.max_prompt_length=252; set task.filter_overlong_prompts=true"):
        sampler().draw(0, 1, 0, 4)  # file order: rows 0-3
    s = sampler("task.filter_overlong_prompts=true")
    keys = s.draw(0, 1, 0, 4)
    assert keys[:3] == [0, 1, 2] and keys[3] != 3 and s.counters() == {"rollout/overlong_prompts_filtered_total": 1}
    assert s.draw(0, 1, 0, 4) == keys, "the replacement is a pure function of (seed, step, round, position)"
    assert 3 not in s.val(8) and s.counters()["rollout/overlong_prompts_filtered_total"] == 3
    assert sampler("task.max_prompt_length=600").draw(0, 1, 0, 4) == [0, 1, 2, 3]
    # policy.max_total_sequence_length bounds it too (a response is cut to fit, but needs a token): the driver refuses
    # the row by name, where the rollout actor used to fail mid-run on it naming no row
    assert sampler("policy.max_total_sequence_length=100").limit == 99
    with pytest.raises(ConfigError, match=rf"task path '{data}' row 3 \(step 1\): .* more than task.max_prompt_length=99"):
        sampler("policy.max_total_sequence_length=100").draw(0, 1, 0, 4)
    # truncation: the driver lets it through, the rollout actor cuts it
    assert sampler("task.truncation=left").draw(0, 1, 0, 4) == [0, 1, 2, 3]
    assert truncate(list(range(10)), 4, "left") == [6, 7, 8, 9] and truncate(list(range(10)), 4, "right") == [0, 1, 2, 3]
    w = worker(*base[:-2], "task.truncation=left")
    ids, text = w.prompt(3)
    assert len(ids) == 252 and ids == encode_prompt(tok, w.task.text(3))[-252:]
    assert text == tok.decode(ids, skip_special_tokens=True) and text != w.task.text(3)  # prompt_text: what was kept


def test_a_file_of_the_size_people_use_is_mapped_not_loaded(tmp_path):
    """100,000 rows, 1,000 prompts x 100 copies: the rows are a memory-mapped copy; the driver's pools are row ids;
    every key names its own row."""
    n = 100_000
    content = pa.array([f"what is {i}+1?" for i in range(1000)])
    which = pa.array(np.arange(n) % 1000)
    table = pa.table({
        "data_source": pa.array(["add"] * n),
        "prompt": pa.ListArray.from_arrays(pa.array(np.arange(n + 1, dtype=np.int32)), pa.StructArray.from_arrays(
            [pa.array(["user"] * n), content.take(which)], names=["role", "content"])),
        "reward_model": pa.StructArray.from_arrays([pa.array(["rule"] * n), pa.array(np.arange(n).astype(str))],
                                                   names=["style", "ground_truth"]),
    })
    pq.write_table(table, tmp_path / "big.parquet")
    tok = load_tokenizer(build_tiny(0))
    t = DatasetTask(str(tmp_path / "big.parquet"), tokenizer=tok)
    assert len(t.train_rows) + len(t.val_rows) == n and len(t.val_rows) == 200 * 100  # a fifth of the prompts, every copy
    held = {t.text(int(k)) for k in t.val_rows}
    assert len(held) == 200 and not held & {t.text(int(k)) for k in t.train_rows[:2000]}
    keys = t.prompts(0, 3, 0, 64)
    assert len(set(keys)) == 64 and all(t.row(k).ground_truth == str(k) for k in keys)
    assert t.files[0].table.column("prompt").chunks[0].buffers()[-1].is_cpu  # mapped Arrow buffers, not Python rows
    assert math.isclose(len(t.train_rows) / n, 0.8)


def test_the_mapped_copy_is_made_once_per_version_of_the_file(tmp_path, monkeypatch):
    monkeypatch.setenv("DATAPLANE_RL_CACHE", str(tmp_path / "cache"))
    from dataplane_rl.tasks.dataset_file import open_dataset

    f = verl_file(tmp_path / "d.parquet", ["what is 1+1?", "what is 2+2?"], ["2", "4"])
    first = open_dataset(f)
    copies = list((tmp_path / "cache" / "datasets").iterdir())
    assert len(copies) == 1 and oct(copies[0].stat().st_mode & 0o777) == "0o600"
    assert oct((tmp_path / "cache" / "datasets").stat().st_mode & 0o777) == "0o700"
    mtime = copies[0].stat().st_mtime_ns
    assert open_dataset(f).equals(first) and copies[0].stat().st_mtime_ns == mtime, "the copy is reused"
    verl_file(tmp_path / "d.parquet", ["what is 3+3?"] * 3, ["6"] * 3)  # a new version: a new copy, the old one gone
    assert open_dataset(f).num_rows == 3 and len(list((tmp_path / "cache" / "datasets").iterdir())) == 1
    (copy,) = (tmp_path / "cache" / "datasets").iterdir()
    copy.write_bytes(b"not arrow")  # a damaged copy is derived data: made again
    assert open_dataset(f).num_rows == 3 and copy.stat().st_size > 9
    # a file rewritten with the same size and mtime (a copy tool keeping times, a coarse clock) is a new version
    g = jsonl(tmp_path / "g.jsonl", [{"prompt": "what is 1+1?", "reward_model": {"ground_truth": "2"}}])
    assert open_dataset(g).column("reward_model").to_pylist() == [{"ground_truth": "2"}]
    st = os.stat(g)
    jsonl(tmp_path / "g.jsonl", [{"prompt": "what is 1+1?", "reward_model": {"ground_truth": "3"}}])
    os.utime(g, ns=(st.st_atime_ns, st.st_mtime_ns))
    assert os.stat(g).st_size == st.st_size and os.stat(g).st_mtime_ns == st.st_mtime_ns
    assert open_dataset(g).column("reward_model").to_pylist() == [{"ground_truth": "3"}]
