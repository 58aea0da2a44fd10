"""Multi-turn rollouts (docs/multiturn.md): the peers' bug classes as properties of real rollouts of the tiny model.

Stored tokens are exactly the sampled tokens plus the tokenized observations; masks, log-prob fills and turn
indices line up; observation tokens get exactly zero gradient and never count as trained tokens; longer
observations change neither advantages nor the loss; the HF engine's log-probs are the trainer's; bad
environment output is one line naming task, turn and row, with nothing stored.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pyarrow as pa
import pytest
import torch

from dataplane_rl.algorithms.grpo import advantages
from dataplane_rl.algorithms.loss import ClippedPGLoss, LossConfig
from dataplane_rl.config import load_config
from dataplane_rl.errors import ConfigError
from dataplane_rl.rollout.multiturn import Env, Episode, EpisodeError, check_prefix
from dataplane_rl.rollout.worker import RolloutJob, RolloutWorker
from dataplane_rl.schema import load_schema
from dataplane_rl.tasks.multiturn import EnvStep, GuessTask, ToolTask, actions_of_row
from dataplane_rl.train.batch import build_train_batch
from dataplane_rl.columns.rowsets import shard_balanced
from dataplane_rl.train.counts import local_counts
from dataplane_rl.model.load import build_tiny, load_model
from dataplane_rl.model.logprobs import token_logprobs

MT = ["policy.max_total_sequence_length=48", "generation.max_new_tokens=1", "multi_turn.max_turns=3"]


class Recorder:
    """The real engine, with every call's inputs and outputs kept (to compare the stored rows with)."""

    def __init__(self, engine) -> None:
        self.engine, self.calls = engine, []

    def generate(self, prompts, seeds, max_new_tokens, *args):
        out = self.engine.generate(prompts, seeds, max_new_tokens, *args)
        self.calls.append(([list(p) for p in prompts], [dataclasses.replace(g) for g in out]))
        return out

    def load_weights(self, sd) -> None:
        self.engine.load_weights(sd)


def worker_for(task: str, *overrides: str, store_url: str | None = None) -> RolloutWorker:
    cfg = load_config(None, [f"task.name={task}", *MT, *overrides])
    w = RolloutWorker(cfg.model_dump(mode="json", by_alias=True), str(build_tiny(cfg.grpo.seed)), store_url, 1)
    w.engine = Recorder(w.engine)
    return w


def job(w: RolloutWorker, P: int = 4, pid: str = "step-000001") -> RolloutJob:
    return RolloutJob(pid, 1, 0, 0, list(range(P)), w.task.prompts(0, 1, 0, P))


@pytest.fixture(scope="module")
def guess():
    """32 guess episodes (4 prompts x G=8) and the recorded engine calls."""
    w = worker_for("guess")
    table, _ = w.generate(job(w))
    return w, table


def rows(table: pa.Table) -> list[dict]:
    return table.to_pylist()


def test_stored_tokens_are_the_sampled_tokens_plus_the_observations(guess):
    w, table = guess
    tok, task = w.tokenizer, w.task
    # per row, what the engine sampled in each turn: calls are turns; a row is in every call until its end
    G = w.cfg.grpo.num_generations_per_prompt
    rows_ = rows(table)
    for i, r in enumerate(rows_):
        prompt_ids = w.encode(r["prompt_text"])
        want, mask, glp, turn, actions = list(prompt_ids), [0] * len(prompt_ids), [0.0] * len(prompt_ids), \
            [0] * len(prompt_ids), []
        for k, (inputs, gens) in enumerate(w.engine.calls, 1):
            if len(actions) == r["num_turns"]:
                break
            at = sum(x["num_turns"] >= k for x in rows_[:i])  # the live rows of a turn go in row order
            assert inputs[at] == want, f"row {i} turn {k}: the engine's input is not the stored trajectory so far"
            g = gens[at]
            actions.append(tok.decode(g.tokens, skip_special_tokens=True))
            obs = task.step(r["prompt_text"], actions).observation
            obs_ids = tok(obs, add_special_tokens=False).input_ids if obs else []
            want += g.tokens + obs_ids
            mask += [1] * len(g.tokens) + [0] * len(obs_ids)
            glp += g.logprobs + [0.0] * len(obs_ids)
            turn += [k] * (len(g.tokens) + len(obs_ids))
        assert r["input_ids"] == want and r["input_lengths"] == len(want)
        assert r["token_mask"] == mask and r["turn_index"] == turn
        assert np.array_equal(np.float32(r["generation_logprobs"]), np.float32(glp))  # 0.0 off the mask, never 1 or NaN
        assert r["observation_tokens"] == mask.count(0) - len(prompt_ids)
        assert r["num_turns"] == len(actions) == max(turn)
        # pure: the row re-scores from its own tokens
        assert actions_of_row(tok, r["input_ids"], r["token_mask"], r["turn_index"]) == actions
        assert r["total_reward"] == task.reward(r["prompt_text"], actions)
        assert r["end_reason"] == ("done" if task.step(r["prompt_text"], actions).done else "max_turns")
    assert len(rows_) == 4 * G
    assert {r["end_reason"] for r in rows_} == {"done"}  # 3 guesses: the task itself ends every episode
    assert len({r["num_turns"] for r in rows_}) > 1, "some episodes should end early (a hit or not)"


def test_hf_generation_logprobs_equal_the_trainers_on_trained_tokens(guess):
    _, table = guess
    schema = load_schema("grpo")
    batch = build_train_batch(table.select(["input_ids", "input_lengths", "token_mask", "generation_logprobs"]), schema)
    model = load_model(build_tiny(0), torch.device("cpu"))
    with torch.no_grad():
        lp = token_logprobs(model, batch["input_ids"], batch["attention_mask"])  # [B, T]
    m = batch["token_mask"].bool()
    assert m.sum() > 0
    assert (lp[m] - batch["generation_logprobs"][m]).abs().max() < 1e-5
    assert (batch["generation_logprobs"][~m] == 0).all()


def train_batch(table: pa.Table, seed: int = 0) -> dict[str, torch.Tensor]:
    """The worker's train batch of the rows, with prev/reference log-probs and per-sample driver columns."""
    schema = load_schema("grpo")
    rewards = table.column("total_reward").to_numpy().astype(np.float64)
    adv = advantages(rewards, table.column("group_id").to_numpy())
    if not np.any(adv):  # a step where no group has spread still must train something here
        adv = np.random.default_rng(seed).normal(size=len(rewards))
    n = table.num_rows
    lp = table.column("generation_logprobs")
    ref = pa.array([[x - 0.1 for x in row] for row in lp.to_pylist()], pa.list_(pa.float32()))
    t = table.select(["input_ids", "input_lengths", "token_mask", "generation_logprobs", "total_reward"]).append_column(
        "prev_logprobs", lp).append_column("reference_policy_logprobs", ref).append_column(
        "advantages", pa.array(adv.astype(np.float32))).append_column("sample_mask", pa.array(np.ones(n, np.int8)))
    return build_train_batch(t, schema)


def test_observation_tokens_get_exactly_zero_gradient(guess):
    _, table = guess
    batch = train_batch(table)
    model = load_model(build_tiny(0), torch.device("cpu"))
    kept = {}

    def keep(module, inputs, out):  # the logits, with their gradient kept
        out.retain_grad()
        kept["logits"] = out

    model.lm_head.register_forward_hook(keep)
    loss_fn = ClippedPGLoss(LossConfig(reference_policy_kl_penalty=0.05, positive_example_nll_weight=0.1))
    lp = token_logprobs(model, batch["input_ids"], batch["attention_mask"])  # [B, T]
    loss, _ = loss_fn(lp, batch, local_counts(batch))
    loss.backward()
    grad = kept["logits"].grad  # [B, T, V]; row t-1 predicts token t
    trained = batch["token_mask"].bool()  # [B, T]
    not_trained = ~trained[:, 1:]  # [B, T-1]: tokens 1.. that are prompt, observation or padding
    assert (grad[:, :-1][not_trained] == 0).all(), "a prompt, observation or padding token got gradient"
    assert (grad[:, :-1][trained[:, 1:]].abs().sum(-1) > 0).all(), "every sampled token must get gradient"
    obs = (batch["attention_mask"].bool() & ~trained)[:, 1:] & (torch.arange(1, grad.shape[1]) > 14)  # past the prompt
    assert obs.sum() > 100, "the rows must hold observation tokens for this test to mean anything"


def test_global_token_count_is_the_policys_sampled_tokens(guess):
    w, table = guess
    batch = train_batch(table)
    sampled = sum(len(g.tokens) for _, gens in w.engine.calls for g in gens)
    lengths = batch["input_lengths"].numpy()
    shards = shard_balanced(lengths, 2)  # two ranks; all_reduce_counts sums their local counts
    per_rank = [local_counts({k: v[torch.as_tensor(s)] for k, v in batch.items()}) for s in shards]
    assert sum(c.tokens for c in per_rank) == local_counts(batch).tokens == sampled
    assert sum(c.sequences for c in per_rank) == table.num_rows


def lengthen_observations(batch: dict[str, torch.Tensor], extra: int, rng) -> dict[str, torch.Tensor]:
    """The batch with `extra` more tokens after every observation token run's first token (masked, random ids
    and log-probs there): what a longer observation looks like to the loss."""
    out = {k: [] for k in batch if batch[k].dim() == 2}
    B = batch["token_mask"].shape[0]
    for b in range(B):
        n = int(batch["attention_mask"][b].sum())
        m = batch["token_mask"][b, :n]
        inserts = [t for t in range(1, n) if m[t] == 0 and m[t - 1] == 1]  # the first token of each observation
        for k, rows_k in out.items():
            row = batch[k][b, :n].tolist()
            for t in reversed(inserts):
                if k == "token_mask":
                    fill = [0] * extra
                elif k == "attention_mask":
                    fill = [1] * extra
                elif k == "input_ids":
                    fill = rng.integers(3, 50, extra).tolist()
                else:
                    fill = rng.normal(-3, 2, extra).tolist()  # anything: never read where token_mask is 0
                row[t:t] = fill
            rows_k.append(row)
    T = max(len(r) for r in out["token_mask"])
    res = {k: torch.tensor([r + [0] * (T - len(r)) for r in v], dtype=batch[k].dtype) for k, v in out.items()}
    res.update({k: v for k, v in batch.items() if v.dim() == 1})
    res["input_lengths"] = res["attention_mask"].sum(-1)
    return res


# bounded: seq-mask-tis and the error threshold; the observations' random log-probs, were they read,
# would push every geometric mean and sequence error out of these bounds (and change the counts)
BOUNDS = dict(truncated_importance_sampling_type="seq-mask-tis", truncated_importance_sampling_ratio=1.01,
              truncated_importance_sampling_ratio_min=0.99)


@pytest.mark.parametrize("token_level,bounded", [(True, False), (False, False), (True, True)])
def test_longer_observations_leave_advantages_and_the_loss_unchanged(guess, token_level, bounded):
    _, table = guess
    batch = train_batch(table)
    longer = lengthen_observations(batch, 7, np.random.default_rng(1))
    assert longer["input_ids"].shape[1] > batch["input_ids"].shape[1]
    threshold = 1.5 if bounded else None
    loss_fn = ClippedPGLoss(LossConfig(reference_policy_kl_penalty=0.05, positive_example_nll_weight=0.1,
                                       token_level_loss=token_level, use_importance_sampling_correction=True,
                                       **(BOUNDS if bounded else {})), threshold)
    rng = np.random.default_rng(2)
    trained = batch["token_mask"].bool()
    moved = batch["prev_logprobs"][trained] + torch.tensor(rng.normal(0, 0.3, int(trained.sum())), dtype=torch.float32)

    def current_lp(b):  # the policy's log-probs: the same values on the sampled tokens (row-major), noise elsewhere
        lp = torch.tensor(rng.normal(-3, 2, b["token_mask"].shape), dtype=torch.float32)
        lp[b["token_mask"].bool()] = moved
        return lp

    a_loss, a_m = loss_fn(current_lp(batch), batch, local_counts(batch, threshold))
    b_loss, b_m = loss_fn(current_lp(longer), longer, local_counts(longer, threshold))
    assert local_counts(batch, threshold) == local_counts(longer, threshold)
    if bounded:
        assert float(a_m["num_masked_seqs"]) == 0 == float(a_m["is_masked_seqs"]) and float(a_m["num_valid_tokens"]) > 0
    assert float(a_m["pg_loss"]) != 0 and float(a_m["clip_fraction"]) > 0  # the terms are really at work
    # equal but for float32 summation order (the rows are longer, so reductions group differently)
    assert float(a_loss) == pytest.approx(float(b_loss), rel=1e-6, abs=1e-7)
    for k in a_m:
        assert float(a_m[k]) == pytest.approx(float(b_m[k]), rel=1e-6, abs=1e-7), k
    # advantages are per sample, from rewards and groups only
    rewards = table.column("total_reward").to_numpy().astype(np.float64)
    groups = table.column("group_id").to_numpy()
    assert np.array_equal(advantages(rewards, groups), advantages(rewards.copy(), groups.copy()))


def test_a_re_rendered_history_is_refused_when_the_row_is_written():
    w = worker_for("guess")
    env = Env(w.task, w.tokenizer, "step-000001")
    p = w.encode("guess 0001 1-7:")
    e = Episode("guess 0001 1-7:", 5, 0, list(p))
    e.inputs.append(tuple(p))
    e.add([12], [-1.0], 1)
    e.outputs.append([12])
    obs = w.tokenizer("lower, 1-3:", add_special_tokens=False).input_ids
    e.add(obs, None, 1)
    e.observations.append(obs)
    e.inputs.append(tuple(e.ids))
    check_prefix(env, e)  # the real history: fine
    e.inputs[1] = tuple(p + [12] + obs[:-1] + [13])  # the same text, re-rendered with another last token
    with pytest.raises(EpisodeError, match=r"task 'guess' turn 2 row 5 .*not a prefix"):
        check_prefix(env, e)


@dataclasses.dataclass
class Broken(GuessTask):
    """guess, with a fault at turn 2."""

    fault: str = "raise"

    def step(self, prompt, actions):
        if len(actions) < 2:
            return super().step(prompt, actions)
        return {"raise": lambda: 1 / 0, "not_text": lambda: EnvStep(7, False, 0.0),
                "empty": lambda: EnvStep("", False, 0.0), "unencodable": lambda: EnvStep("HIGHER", False, 0.0),
                "reward": lambda: EnvStep("x:", True, float("nan"))}[self.fault]()


# an environment that raises is a data failure, retried and then failing its group: tests/test_faults.py
@pytest.mark.parametrize("fault,says", [("not_text", "must be a string"),
                                         ("empty", "empty observation"), ("unencodable", "cannot encode"),
                                         ("reward", "finite number")])
def test_bad_environment_output_is_one_line_naming_task_turn_and_row(tmp_path, fault, says):
    from dataplane_rl.store import open_store

    store = open_store(f"shm://{tmp_path / 'store'}")
    try:
        w = worker_for("guess", store_url=store.url)
        w.task = Broken(fault=fault)
        j = job(w, P=2)
        store.create_partition(j.pid, load_schema("grpo"), 2 * w.cfg.grpo.num_generations_per_prompt)
        with pytest.raises(EpisodeError) as e:
            w.generate(j)
        msg = str(e.value)
        assert "\n" not in msg and says in msg, msg
        assert msg.startswith("task 'guess' turn 2 row ") and "partition step-000001" in msg, msg
        assert not any(store.status(j.pid).rows_written.values()), "nothing of the job may be stored"
        w.close()
    finally:
        store.close()


def test_an_observation_past_the_length_limit_is_cut_and_ends_the_episode():
    # prompt 11 (BOS and 'tool 0012:'), action 1, then 'key=7:' (6) > 3
    w = worker_for("tool", "policy.max_total_sequence_length=15")
    table, _ = w.generate(job(w, P=2))
    for r in rows(table):
        assert r["input_lengths"] == 15 and r["end_reason"] == "length" and r["truncated"] and r["num_turns"] == 1
        assert r["token_mask"].count(1) == 1 and r["observation_tokens"] == 3


def test_max_turns_below_one_is_refused_naming_the_key():
    with pytest.raises(ConfigError, match="multi_turn.max_turns"):
        load_config(None, ["multi_turn.max_turns=0"])


def test_a_multi_turn_task_needs_a_total_length_limit():
    from dataplane_rl.driver.preflight import preflight

    with pytest.raises(ConfigError, match="policy.max_total_sequence_length"):
        preflight(load_config(None, ["task.name=guess"]))


def test_max_turns_ends_episodes_as_max_turns():
    w = worker_for("guess", "multi_turn.max_turns=1")
    table, _ = w.generate(job(w, P=2))
    for r in rows(table):
        assert r["num_turns"] == 1
        assert r["end_reason"] == ("done" if r["total_reward"] == 1.0 else "max_turns")


def test_tool_task_needs_the_key_from_the_observation():
    task = ToolTask()
    p = task.prompts(0, 1, 0, 1)[0]
    obs = task.step(p, ["?"]).observation
    key = obs.removeprefix("key=").removesuffix(":")
    assert key.isdigit() and task.reward(p, ["?", key]) == 1.0 and task.reward(p, ["?", str((int(key) + 1) % 10)]) == 0.0
    keys = {task.step(q, ["?"]).observation for q in task.prompts(0, 1, 0, 64)}
    assert len(keys) == 10, "the key must vary between episodes"


def test_guess_task_rules():
    task = GuessTask()
    p = next(q for q in task.prompts(0, 1, 0, 200) if task.step(q, ["4"]).observation == "higher, 5-7:")
    assert p.endswith(" 1-7:") and task.step(p, ["4", "9"]).observation == "invalid, 5-7:"
    # binary search on the range shown always wins within 3 guesses; the range is the feedback's
    wins = 0
    for q in task.prompts(0, 2, 0, 50):
        lo, hi, actions = 1, 7, []
        while True:
            actions.append(str((lo + hi) // 2))
            s = task.step(q, actions)
            if s.done:
                break
            lo, hi = (int(x) for x in s.observation.split(", ")[1].rstrip(":").split("-"))
        wins += s.reward == 1.0 and len(actions) <= 3
    assert wins == 50
    # a guesser ignoring the feedback does not always win
    assert sum(task.reward(q, ["4", "2", "6"]) for q in task.prompts(0, 2, 0, 50)) < 50


def test_single_turn_rows_carry_the_turn_columns():
    cfg = load_config(None, ["generation.max_new_tokens=4"])
    w = RolloutWorker(cfg.model_dump(mode="json", by_alias=True), str(build_tiny(0)), None, 1)
    table, _ = w.generate(job(w, P=2))
    for r in rows(table):
        assert r["turn_index"] == r["token_mask"] and r["num_turns"] == 1 and r["observation_tokens"] == 0
        assert r["end_reason"] == ("length" if r["truncated"] else "done")
