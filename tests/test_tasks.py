"""Tasks: held-out validation prompts disjoint from training prompts, and the math answer extractor."""

from __future__ import annotations

import json

import pytest

from dataplane_rl.errors import ConfigError
from dataplane_rl.tasks import TASKS, MathJsonlTask, get_task
from dataplane_rl.tasks.answers import extract_answer, normalize_number


@pytest.mark.parametrize("name", sorted(TASKS))
def test_held_out_prompts_are_disjoint_from_training_prompts(name):
    task = get_task(name)
    val = task.val_prompts(10_000)
    assert val and len(set(val)) == len(val)
    assert task.val_prompts(10_000) == val, "the held-out set must not change between calls"
    assert task.val_prompts(3) == val[:3]
    seen = set()
    for seed in (0, 1):
        for step in range(1, 200):
            for round_ in (0, 1):
                seen.update(task.prompts(seed, step, round_, 16))
    assert not seen & set(val), f"{name}: training drew held-out prompts {sorted(seen & set(val))[:5]}"
    assert len(seen) > len(val), "training must see many distinct prompts"
    for p in val:  # held-out prompts are scored like any other
        assert 0.0 <= task.reward(p, "123456") <= 1.0


def test_digit_tasks_hold_out_a_fifth_and_score_by_the_last_digit():
    task = get_task("next")
    assert len(task.val_pool) == 200 and len(task.train_pool) == 800
    assert task.reward("407", "888888") == 1.0 and task.reward("409", "000000xx") == 1.0
    assert task.reward("407", "888777") == 0.5 and task.reward("407", "777777") == 0.0
    assert get_task("repeat").reward("407", "777777") == 1.0
    assert get_task("count").reward("407", "890123") == 1.0


def test_math_split_keeps_both_sides_and_refuses_one_question(tmp_path):
    p = tmp_path / "q.jsonl"
    p.write_text(json.dumps({"question": "1+1", "answer": "2"}) + "\n")
    with pytest.raises(ConfigError, match="at least 2 distinct prompts"):
        MathJsonlTask(str(p))
    p.write_text("".join(json.dumps({"question": f"{i}+1", "answer": str(i + 1)}) + "\n" for i in range(3)))
    task = MathJsonlTask(str(p))
    assert len(task.val_pool) == 1 and len(task.train_pool) == 2


# (response, extracted, normalised); a GSM8K reference answer goes through the same extractor
EXTRACT = [
    ("#### 42", "42", "42"),
    ("She pays 3 * 4 = 12 dollars.\n#### 12", "12", "12"),
    ("first 7\n#### 1,000\n", "1,000", "1000"),
    ("#### 3\nlater #### 5", "5", "5"),                      # the last #### wins
    ("answer: 42", "42", "42"),
    ("The answer is 42.0", "42.0", "42"),
    ("Answer = -7", "-7", "-7"),
    ("so 2 + 2 = 4, answer: 4 apples", "4", "4"),
    ("I think 3, no 5", "5", "5"),                           # the last number
    ("1,2,3", "3", "3"),                                     # not a thousands group: three numbers
    ("costs $1,250.50 in total", "1,250.50", "1250.5"),
    ("0.50", "0.50", "0.5"),
    ("answer: blue", "blue", None),                          # non-numeric answers compare as text
    ("no digits here", "no digits here", None),
    ("   ", None, None),
    ("", None, None),
]


@pytest.mark.parametrize("response,extracted,normalised", EXTRACT)
def test_extract_answer(response, extracted, normalised):
    assert extract_answer(response) == extracted
    assert normalize_number(extracted) == normalised


@pytest.mark.parametrize("text,want", [("42", "42"), ("42.0", "42"), ("+42", "42"), ("1,000", "1000"),
                                       ("1,000.00", "1000"), ("-0.250", "-0.25"), ("4.", "4"), ("x", None),
                                       ("1.2.3", None), (None, None)])
def test_normalize_number(text, want):
    assert normalize_number(text) == want


def test_math_task_reward_on_the_sample_file():
    task = get_task("math_jsonl")
    by_q = {q: a for q, a in task.items}
    pens = MathJsonlTask.format("A box holds 250 pens. How many pens are in 4 boxes?")
    assert by_q["A box holds 250 pens. How many pens are in 4 boxes?"] == "1,000"  # from '#### 1,000'
    for response, want in [("1000", 1.0), ("4 * 250 = 1,000\n#### 1,000", 1.0), ("answer: 1000.0", 1.0),
                           ("1,000 pens", 1.0), ("1000 pens, no 999", 0.0), ("", 0.0), ("many", 0.0)]:
        assert task.reward(pens, response) == want, response
    half = MathJsonlTask.format("Half of 9 is?")
    assert task.reward(half, "answer: 4.50") == 1.0 and task.reward(half, "4") == 0.0
    with pytest.raises(ConfigError, match="not a question"):
        task.reward("Q: what?\nA: ", "1")


def test_a_task_without_held_out_prompts_is_refused_before_the_start():
    from dataplane_rl.config import load_config
    from dataplane_rl.tasks import register_task
    from dataplane_rl.driver.loop import Fleet

    class NoHeldOut:
        name = "no_held_out"

        def prompts(self, seed, step, round_, n):
            return ["1"] * n

        def reward(self, prompt, response):
            return 0.0

    register_task("no_held_out", lambda path=None: NoHeldOut())
    try:
        with pytest.raises(ConfigError, match=r"no_held_out.*val_prompts.*grpo.val_period=0"):
            Fleet(load_config(None, ["task.name=no_held_out"]))
        Fleet(load_config(None, ["task.name=no_held_out", "grpo.val_period=0"]))  # no validation: fine
    finally:
        TASKS.pop("no_held_out")
