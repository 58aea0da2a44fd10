"""What a run shows: reward.png (title, coinciding lines, the loss panel) and the progress bar."""

from __future__ import annotations

import io

import pytest

from dataplane_rl.driver.loop import StepProgress
from dataplane_rl.run.plot import reward_figure, run_title, save_reward_png


def metrics(n, filtered_offset=0.0):
    return [{"step": s, "train/reward": 0.1 * s, "train/filtered_reward": 0.1 * s + filtered_offset,
             "train/loss": 0.01, "train/kl_penalty": 0.001 * s, "train/entropy": 3.9 - 0.1 * s,
             "timing/step": 1.5} for s in range(1, n + 1)]


def labels(ax):
    return [line.get_label() for line in ax.get_lines()]


def test_title_names_task_model_and_steps():
    cfg = {"task": {"name": "math_jsonl", "path": "/data/q.jsonl"}, "policy": {"model": "/models/qwen-0.5b"},
           "grpo": {"max_num_steps": 30}}
    assert run_title(cfg, 12) == "GRPO math_jsonl (q.jsonl) · model qwen-0.5b · 12/30 steps"
    fig = reward_figure(metrics(3), "T")
    assert fig._suptitle.get_text() == "T"


def test_coinciding_reward_lines_are_drawn_once_and_labelled():
    top = reward_figure(metrics(3), "t").axes[0]
    assert labels(top) == ["train/reward = train/filtered_reward (no rows filtered)"]
    top = reward_figure(metrics(3, filtered_offset=0.05), "t").axes[0]
    assert labels(top) == ["train/reward (all rounds)", "train/filtered_reward (rows trained on)"]


def test_loss_and_kl_on_their_own_axes_entropy_below_legends_off_the_curves(tmp_path):
    fig = reward_figure(metrics(4), "t")
    top, loss, entropy, kl = fig.axes  # the KL penalty's axis is the loss panel's twin
    assert labels(loss) == ["train/loss"] and labels(kl) == ["train/kl_penalty"] and kl.bbox.bounds == loss.bbox.bounds
    assert labels(entropy) == ["train/entropy"]
    assert list(entropy.get_lines()[0].get_ydata()) == pytest.approx([3.8, 3.7, 3.6, 3.5])
    # each axis spans its own data: the KL penalty (0.001-0.004) is not flattened on the loss's scale
    assert kl.get_ylim()[1] < 0.01 and loss.get_ylim()[0] > 0.005
    fig.canvas.draw()
    for ax in (top, loss, entropy):  # every legend sits above its panel, none on the curves
        assert ax.get_legend().get_window_extent().y0 >= ax.get_window_extent().y1 - 1
    assert [t.get_text() for t in loss.get_legend().get_texts()] == ["train/loss", "train/kl_penalty"]
    save_reward_png(metrics(4), "t", tmp_path / "reward.png")
    assert (tmp_path / "reward.png").stat().st_size > 0 and not list(tmp_path.glob("*.tmp*"))


def test_progress_bar_shows_a_steps_numbers_only_once_it_is_done():
    out = io.StringIO()
    bar = StepProgress(2, file=out, mininterval=0)
    assert "reward=" not in out.getvalue()
    bar.step_done({"train/reward": 0.25, "train/loss": 0.5, "timing/step": 1.0})
    bar.step_done({"train/reward": 0.75, "train/loss": 0.5, "timing/step": 1.0})
    bar.close()
    frames = out.getvalue().replace("\n", "\r").split("\r")
    for frame in frames:
        if "reward=0.250" in frame:
            assert "1/2" in frame, frame
        if "reward=0.750" in frame:
            assert "2/2" in frame, frame
    assert any("1/2" in f and "reward=0.250" in f for f in frames)


def test_without_the_bar_a_line_every_n_steps_and_at_the_last():
    out = io.StringIO()
    bar = StepProgress(5, enabled=False, file=out, every=2)
    for s in range(1, 6):
        bar.step_done({"train/reward": 0.1 * s, "train/loss": 0.5, "timing/step": 1.0})
    bar.close()
    lines = out.getvalue().splitlines()
    assert [ln.split(":")[0] for ln in lines] == ["grpo step 2/5", "grpo step 4/5", "grpo step 5/5"]
    assert "reward 0.500" in lines[-1]


def test_entropy_from_the_train_pass_logits():
    """train/entropy's per-token value: uniform logits over V give ln V; a one-hot-ish row gives ~0.
    Position 0 (no prediction) and padding are 0, like the log-probs."""
    import math
    from types import SimpleNamespace

    import torch

    from dataplane_rl.model.logprobs import token_logprobs

    V = 5
    logits = torch.zeros(2, 3, V)  # [B, T, V]: row 0 uniform
    logits[1, :, 0] = 50.0  # row 1: all mass on token 0
    model = lambda input_ids, attention_mask: SimpleNamespace(logits=logits)  # noqa: E731
    ids = torch.zeros(2, 3, dtype=torch.long)  # [B, T]
    mask = torch.tensor([[1, 1, 1], [1, 1, 0]])  # [B, T] row 1 padded at the end
    lp, ent = token_logprobs(model, ids, mask, with_entropy=True)
    assert ent[0].tolist() == pytest.approx([0.0, math.log(V), math.log(V)])
    assert ent[1].tolist() == pytest.approx([0.0, 0.0, 0.0], abs=1e-6)
    assert lp[0, 1:].tolist() == pytest.approx([-math.log(V)] * 2)


def test_a_resumed_runs_bar_starts_at_the_steps_done():
    out = io.StringIO()
    bar = StepProgress(5, file=out, mininterval=0, initial=3)
    bar.step_done({"train/reward": 0.5, "train/loss": 0.1, "timing/step": 1.0})
    bar.close()
    frames = out.getvalue().replace("\n", "\r").split("\r")
    assert all("4/5" in f for f in frames if "reward=0.500" in f) and any("reward=0.500" in f for f in frames)
