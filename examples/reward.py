"""A reward function with verl's signature: task.reward_function=examples/reward.py:compute_score."""

import re


def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    """1.0 for the right number, 0.1 for a wrong number (the format is right), 0.0 without one.

    data_source: the row's source ('add' or 'sub' in examples/data); extra_info: the row's dict."""
    m = re.match(r"\s*(-?\d+)", solution_str)
    if m is None:
        return {"score": 0.0, "correct": False}
    correct = m.group(1) == str(ground_truth)
    return {"score": 1.0 if correct else 0.1, "correct": correct}
