"""Your own data, reward and environment (docs/tasks.md): task.module, task.name=dataset, task.reward_function, chat
templates, and the data_source/extra_info columns, through the real rollout worker and the tiny model."""

from __future__ import annotations

import json
import re
import math
import subprocess
import sys
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
from dataplane_rl.tasks import TASKS, load_task
from dataplane_rl.tasks.dataset import DatasetTask, read_rows
from dataplane_rl.tasks.user_code import UserReward, import_user_module

ROOT = Path(__file__).resolve().parents[1]
EXAMPLES = ROOT / "examples"
TRAIN = EXAMPLES / "data" / "train.parquet"
REWARD = f"{EXAMPLES / 'reward.py'}:compute_score"
SMALL = ["grpo.num_generations_per_prompt=2", "generation.max_new_tokens=4"]


def worker(*overrides: str) -> RolloutWorker:
    cfg = load_config(None, [*SMALL, *overrides])
    return RolloutWorker(cfg.model_dump(mode="json", by_alias=True), str(build_tiny(cfg.grpo.seed)), None, 1)


def generate(w: RolloutWorker, P: int = 4, step: int = 1) -> list[dict]:
    table, _ = w.generate(RolloutJob("step-000001", step, 0, 0, list(range(P)), draw(w, step, P)))
    return table.to_pylist()


def draw(w: RolloutWorker, step: int, P: int) -> list:
    """The prompt keys the driver's task draws for `step` (an actor's own task draws none)."""
    return load_task(w.cfg.task, w.tokenizer).prompts(0, step, 0, P)


def user_fn():
    sys.path.insert(0, str(EXAMPLES))
    try:
        import reward  # the user's file, imported as the user would
    finally:
        sys.path.pop(0)
    return reward.compute_score


def test_the_examples_parquet_is_what_its_script_writes(tmp_path):
    """examples/data/*.parquet are reproducible: the committed script writes the same rows."""
    script = (EXAMPLES / "make_data.py").read_text().replace('Path(__file__).resolve().parent / "data"',
                                                             f'Path({str(tmp_path)!r})')
    (tmp_path / "make.py").write_text(script)
    subprocess.run([sys.executable, str(tmp_path / "make.py")], check=True, capture_output=True, timeout=120)
    for name in ("train", "val"):
        assert pq.read_table(tmp_path / f"{name}.parquet").to_pylist() == pq.read_table(TRAIN.with_name(f"{name}.parquet")).to_pylist()
    assert len(read_rows(str(TRAIN))) == 300


def test_dataset_rewards_are_the_users_function_and_the_row_columns_are_stored():
    """verl's layout as it is: chat prompts through the tiny model's template, every total_reward (float32) equals
    compute_score(data_source, response, ground_truth, extra_info) of the row, data_source/extra_info stored."""
    w = worker("task.name=dataset", f"task.path={TRAIN}", f"task.reward_function={REWARD}")
    truth = {f"<bos>user: {r['prompt'][0]['content']}\nassistant: ": r for r in pq.read_table(TRAIN).to_pylist()}
    fn, rows = user_fn(), generate(w, P=8)
    assert len(rows) == 16
    for r in rows:
        src = truth[r["prompt_text"]]  # the chat template rendered the messages (KeyError otherwise)
        assert r["data_source"] == src["data_source"] and json.loads(r["extra_info"]) == src["extra_info"]
        want = fn(src["data_source"], r["response_text"], src["reward_model"]["ground_truth"], src["extra_info"])
        assert r["total_reward"] == np.float32(want["score"])
    assert {r["total_reward"] for r in rows} <= {0.0, np.float32(0.1), 1.0}


def test_built_in_tasks_store_their_name_and_an_empty_extra_info():
    rows = generate(worker("task.name=repeat"), P=2)
    assert {r["data_source"] for r in rows} == {"repeat"} and {r["extra_info"] for r in rows} == {"{}"}


def test_epochs_visit_every_prompt_once_in_a_seeded_order_that_resumes(tmp_path):
    """Steps take consecutive prompts of per-epoch seeded orders: a pure function of (seed, step), so a new
    instance (a resumed run) draws exactly the same; file order with shuffle off; val_path holds out a file."""
    rows = [{"prompt": f"q{i}", "answer": str(i)} for i in range(10)]
    (tmp_path / "a.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows[:6]))
    pq.write_table(pa.Table.from_pylist(rows[6:]), tmp_path / "b.parquet")  # a folder of both kinds
    t = DatasetTask(str(tmp_path), val_path=str(tmp_path / "b.parquet"), output_key="answer")
    # keys are row ids: the folder's 10 rows are 0-9, the val file's 4 rows 10-13 (10 + their position there)
    assert [t.text(k) for k in t.train_rows] == [f"q{i}" for i in range(10)] and t.val_prompts(2) == [10, 11]
    assert [t.text(k) for k in t.val_prompts(2)] == ["q6", "q7"] and t.where(11) == f"task path '{tmp_path / 'b.parquet'}' row 1"
    steps = [t.prompts(7, s, 0, 5) for s in range(1, 5)]  # 20 prompts: two epochs of 10
    for epoch in (steps[0] + steps[1], steps[2] + steps[3]):
        assert sorted(epoch) == list(range(10))
    assert steps[0] + steps[1] != steps[2] + steps[3] and steps[0] + steps[1] != list(range(10))
    again = DatasetTask(str(tmp_path), val_path=str(tmp_path / "b.parquet"), output_key="answer")
    assert [again.prompts(7, s, 0, 5) for s in (4, 2)] == [steps[3], steps[1]]
    assert t.prompts(8, 1, 0, 5) != steps[0]
    in_order = DatasetTask(str(tmp_path / "a.jsonl"), output_key="answer", shuffle=False)
    assert in_order.prompts(0, 1, 0, 3) + in_order.prompts(0, 2, 0, 3) == (in_order.train_rows.tolist() * 2)[:6]
    assert t.row(3).data_source == tmp_path.name and t.reward(3, "the answer is 3") == 1.0
    with pytest.raises(ConfigError, match=r"row 14 is not a row of .*b\.parquet"):
        t.text(14)


def test_dataset_refusals_name_the_row_and_the_fix(tmp_path):
    tok = load_tokenizer(build_tiny(0))
    f = tmp_path / "d.jsonl"
    f.write_text(json.dumps({"question": "q", "answer": 1}) + "\n")
    with pytest.raises(ConfigError, match=r"has no 'prompt' \(task.input_key\); its columns: question, answer"):
        DatasetTask(str(f))
    for bad, what in ((None, "null or empty"), (" ", "null or empty"), (7, "row 1: the prompt is 7; it must be text or chat")):
        f.write_text(json.dumps({"prompt": "ok", "reward_model": {"ground_truth": 1}}) + "\n"
                     + json.dumps({"prompt": bad, "reward_model": {"ground_truth": 1}}) + "\n")
        with pytest.raises(ConfigError, match=rf"d\.jsonl'.*{what}"):
            DatasetTask(str(f))
    f.write_text(json.dumps({"prompt": [{"role": "user", "content": "a"}], "reward_model": {"ground_truth": 1}}) + "\n"
                 + json.dumps({"prompt": [{"role": "user", "content": None}], "reward_model": {"ground_truth": 1}}) + "\n")
    with pytest.raises(ConfigError, match=r"d\.jsonl' row 1: the prompt .* a chat message with a null role or content"):
        DatasetTask(str(f), tokenizer=tok)  # never rendered as the text "None"
    # a null ground truth was scored against the text "None"; a message's content as a list of parts (verl's
    # multimodal layout) or a number was a pyarrow traceback
    ok = {"prompt": "q", "reward_model": {"ground_truth": 1}}
    for row, what in (({"prompt": "q", "reward_model": {"ground_truth": None}}, "the ground truth"),
                      ({"prompt": "q", "reward_model": {"style": "rule"}}, "the ground truth"),
                      ({"prompt": "q"}, "the ground truth"),
                      ({"prompt": "q", "reward_model": {"ground_truth": [1, "a"]}, "extra_info": None}, None)):
        f.write_text(json.dumps(ok) + "\n" + json.dumps(row) + "\n")
        if what is None:  # mixed types, written so: kept
            assert DatasetTask(str(f), val_path=str(f)).row(1).ground_truth == [1, "a"]
            continue
        with pytest.raises(ConfigError, match=rf"d\.jsonl' row 1: {what} \('reward_model\.ground_truth', "
                                              r"task\.output_key\) is null or missing; give the row its ground truth"):
            DatasetTask(str(f), val_path=str(f))
    parts = [{"type": "text", "text": "hi"}]
    for content, held in ((parts, r"list<element: struct<type: string, text: string>>"), (7, "int64")):
        pq.write_table(pa.Table.from_pylist([{"prompt": [{"role": "user", "content": content}],
                                              "reward_model": {"ground_truth": "1"}}] * 2), tmp_path / "m.parquet")
        with pytest.raises(ConfigError, match=rf"m\.parquet' row 0: the chat messages' content \('prompt', "
                                              rf"task\.input_key\) holds {held}, not text; only text is supported"):
            DatasetTask(str(tmp_path / "m.parquet"), val_path=str(tmp_path / "m.parquet"), tokenizer=tok)
    f.write_text(json.dumps({"prompt": [{"role": "user", "content": "hi"}], "reward_model": {"ground_truth": 1}}) + "\n")
    tok.chat_template = None
    with pytest.raises(ConfigError, match=r"chat messages but policy.model's tokenizer has no chat template"):
        DatasetTask(str(f), tokenizer=tok)
    with pytest.raises(Exception, match=r"task.name=dataset needs task.path"):
        load_config(None, ["task.name=dataset"])
    import importlib.util

    if importlib.util.find_spec("datasets") is None:  # a saved `datasets` folder, without the package to read it
        (tmp_path / "saved").mkdir()
        (tmp_path / "saved" / "dataset_info.json").write_text("{}")
        with pytest.raises(ConfigError, match=r"needs the datasets package: pip install datasets"):
            DatasetTask(str(tmp_path / "saved"))
    else:  # the test extra installs datasets: a folder saved by Dataset.save_to_disk reads as the same rows
        import datasets

        rows = [{"data_source": "s", "prompt": f"p{i}", "reward_model": {"ground_truth": str(i)}} for i in range(10)]
        datasets.Dataset.from_list(rows).save_to_disk(str(tmp_path / "saved"))
        task = DatasetTask(str(tmp_path / "saved"), val_path=str(tmp_path / "saved"))
        assert [task.text(k) for k in task.train_rows] == [f"p{i}" for i in range(10)]
        assert task.row(3).ground_truth == "3" and task.row(3).data_source == "s"
        datasets.DatasetDict({"train": datasets.Dataset.from_list(rows), "test": datasets.Dataset.from_list(rows)}
                             ).save_to_disk(str(tmp_path / "splits"))
        with pytest.raises(ConfigError, match=r"test.*train|train.*test"):
            DatasetTask(str(tmp_path / "splits"))


@pytest.mark.parametrize("body, what", [
    ("raise KeyError('gt')", r"raised KeyError: 'gt' \(.*bad\.py:3: raise KeyError\('gt'\)\)"),
    ("return float('nan')", r"returned nan"),
    ("return 'high'", r'returned "high" \(str\)'),
    ("return {'acc': 1.0}", r"returned a dict without 'score' \(keys \['acc'\]\)"),
    ("return True", r"returned true \(bool\), a bool, which is not a score \(return float\(\.\.\.\) for 1\.0/0\.0\)"),
    # one rule for every kind of bool: float() took numpy's and torch's as 1.0 while Python's was refused
    ("return __import__('numpy').bool_(True)", r"returned np\.True_ \(bool\), a bool, which is not a score .*"),
    ("return __import__('numpy').array(False)", r"returned array\(False\) \(ndarray\), a bool, which .*"),
    ("return __import__('torch').tensor(True)", r"returned tensor\(True\) \(Tensor\), a bool, which .*"),
])
def test_a_bad_reward_is_a_data_failure_naming_function_source_and_value(tmp_path, body, what):
    (tmp_path / "bad.py").write_text(f"def compute_score(data_source, solution_str, ground_truth, extra_info=None):\n"
                                     f"    x = 1\n    {body}\n")
    fn = UserReward(f"{tmp_path / 'bad.py'}:compute_score")
    with pytest.raises(RewardFunctionError, match=rf"bad\.py:compute_score {what} for data_source 'gsm8k'"):
        fn("gsm8k", "42", "42", {})


def test_a_bad_reward_fails_its_groups_naming_the_rows_source(tmp_path):
    """A NaN from the user's function is a data failure: retried, then its whole group fails; the
    receipt names the function, the row's data_source and the value, and no row of that group is returned."""
    (tmp_path / "nan.py").write_text("def compute_score(data_source, solution_str, ground_truth, extra_info=None):\n"
                                     "    return float('nan') if data_source == 'sub' else 1.0\n")
    w = worker("task.name=dataset", f"task.path={TRAIN}", f"task.reward_function={tmp_path / 'nan.py'}")
    prompts = draw(w, 1, 8)
    table, receipt = w.generate(RolloutJob("step-000001", 1, 0, 0, list(range(8)), prompts))
    subs = {g for g, p in enumerate(prompts) if w.task.row(p).data_source == "sub"}
    assert subs and len(subs) < 8  # the fixed draw holds both sources
    assert {g for g, reason, _ in receipt["failed_groups"]} == subs
    for _, reason, error in receipt["failed_groups"]:
        assert reason == "reward" and re.search(r"RewardFunctionError: .*nan\.py:compute_score returned nan for "
                                                r"data_source 'sub'", error), error
    rows = table.to_pylist()
    assert {r["data_source"] for r in rows} == {"add"} and {r["group_id"] for r in rows} == set(range(8)) - subs
    assert all(r["total_reward"] == 1.0 for r in rows)


def test_a_module_that_fails_to_import_is_one_error_line_before_ray(tmp_path, capsys):
    from dataplane_rl.cli.main import main

    (tmp_path / "broken.py").write_text("import os\n\nvalue = 1 / 0\n")
    with pytest.raises(ConfigError, match=r"broken\.py' failed to import: ZeroDivisionError: division by zero "
                                          r"\(.*broken\.py:3: value = 1 / 0\)"):
        import_user_module(str(tmp_path / "broken.py"))
    rc = main(["train", f"task.module={tmp_path / 'broken.py'}", f"logger.run_dir={tmp_path / 'never'}"])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and len(err) == 1 and err[0].startswith("error: ConfigError: task.module ") and "broken.py:3" in err[0]
    rc = main(["train", "task.name=shout", f"logger.run_dir={tmp_path / 'never'}"])
    assert rc == 2 and "task.module=FILE.py" in capsys.readouterr().err
    # a row the rollout actors could not render is refused by row before Ray, with task.val_path too
    pq.write_table(pa.Table.from_pylist([{"prompt": [{"role": "user", "content": [{"type": "text", "text": "hi"}]}],
                                          "reward_model": {"ground_truth": "1"}}]), tmp_path / "m.parquet")
    rc = main(["train", "task.name=dataset", f"task.path={tmp_path / 'm.parquet'}",
               f"task.val_path={tmp_path / 'm.parquet'}", f"logger.run_dir={tmp_path / 'never'}"])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and len(err) == 1 and err[0].startswith("error: ConfigError: task path ") and "row 0: the chat" in err[0]


def test_a_modules_environment_runs_multi_turn_and_the_reward_function_scores_the_episode():
    """examples/env.py through task.module: its countdown environment's episodes, scored at their end by the env,
    then (task.reward_function) by the user's function on the episode's response text and the env's row."""
    mt = ["task.name=countdown", f"task.module={EXAMPLES / 'env.py'}", "policy.max_total_sequence_length=48",
          "generation.max_new_tokens=2", "multi_turn.max_turns=3"]
    try:
        w = worker(*mt)
        rows = generate(w)
        assert len(rows) == 8
        for r in rows:
            assert r["num_turns"] >= 1 and r["data_source"] == "countdown" and json.loads(r["extra_info"]) == {"turns": 3}
            assert r["total_reward"] in {np.float32(k / 3) for k in range(4)}
        scored = generate(worker(*mt, f"task.reward_function={REWARD}"))
        fn = user_fn()
        for r in scored:
            gt = " ".join(str(int(r["prompt_text"].split()[1].rstrip(":")) - k) for k in (1, 2, 3))
            assert r["total_reward"] == np.float32(fn("countdown", r["response_text"], gt, {"turns": 3})["score"])
    finally:
        TASKS.pop("countdown", None)


def test_load_task_imports_the_module_once_and_passes_the_tokenizer(tmp_path):
    (tmp_path / "mine.py").write_text(textwrap.dedent("""
        from dataplane_rl.tasks import register_task
        from dataplane_rl.tasks.dataset import DatasetTask
        IMPORTS = globals().setdefault("IMPORTS", 0) + 1
        register_task("mine", lambda path=None, tokenizer=None: DatasetTask(path, tokenizer=tokenizer))
    """))
    (tmp_path / "d.jsonl").write_text("".join(json.dumps({"prompt": [{"role": "user", "content": f"q{i}"}],
                                                          "reward_model": {"ground_truth": i}}) + "\n" for i in range(5)))
    cfg = load_config(None, ["task.name=mine", f"task.module={tmp_path / 'mine.py'}", f"task.path={tmp_path / 'd.jsonl'}"])
    try:
        tok = load_tokenizer(build_tiny(0))
        a, b = load_task(cfg.task, tok), load_task(cfg.task, tok)
        assert import_user_module(cfg.task.module).IMPORTS == 1 and a.train_rows.tolist() == b.train_rows.tolist()
        texts = [a.text(k) for k in [*a.train_rows, *a.val_rows]]
        assert all(p.startswith("<bos>user: q") and p.endswith("assistant: ") for p in texts)
        first = int(a.train_rows[0])
        assert math.isclose(a.reward(first, str(a.row(first).ground_truth)), 1.0)
    finally:
        TASKS.pop("mine", None)


def test_a_chat_prompt_is_its_templates_tokens_with_nothing_added():
    """BOS in a chat prompt is the template's to write (the tiny one does, as Llama's do); the encoder adds none, so
    a template that writes none gets none and one that writes it gets it once."""
    from dataplane_rl.rollout.worker import encode_prompt
    from dataplane_rl.tasks.dataset import render_prompt

    tok = load_tokenizer(build_tiny(0))
    messages = [{"role": "user", "content": "hi"}]
    ids = encode_prompt(tok, render_prompt(messages, tok, "row 0"), chat=True)
    assert ids.count(tok.bos_token_id) == 1 and ids[0] == tok.bos_token_id
    assert ids[1:] == tok("user: hi\nassistant: ", add_special_tokens=False).input_ids
    tok.chat_template = tok.chat_template.replace("{{ bos_token }}", "")
    assert encode_prompt(tok, render_prompt(messages, tok, "row 0"), chat=True) == ids[1:]
