"""The multi-turn rollout: engine turns and environment turns alternate, token in, token out.

A trajectory's tokens are the prompt's, then per turn exactly the tokens the engine sampled and the
tokenized observation appended after them. Each turn's engine input is the trajectory so far, as stored: the
history is never decoded and re-tokenized (the drift behind verl #3720, slime #2288, NeMo-RL #3063), and
`check_prefix` verifies, when the row is written, that every turn's input was the previous turn's input plus
its output plus the observation. token_mask is 1 on sampled tokens only; generation_logprobs is 0.0 elsewhere.

An episode ends when the environment says done (end_reason done), after multi_turn.max_turns policy turns
(max_turns), or when a turn or an observation would pass policy.max_total_sequence_length (length: the turn or
the observation is cut to fit). Bad environment output is a one-line EpisodeError naming task, turn and row;
it is raised before anything of the job is put, so nothing of it is stored.
"""

from __future__ import annotations

import hashlib
import math
from dataclasses import dataclass, field

import numpy as np
import pyarrow as pa

from dataplane_rl.errors import DataPlaneError
from dataplane_rl.rollout.generation import Generation
from dataplane_rl.rollout.retries import DataFailure, Retries
from dataplane_rl.schema import GRPO_SCHEMA
from dataplane_rl.store import schema_table
from dataplane_rl.tasks import row_columns
from dataplane_rl.tasks.values import to_json


class EpisodeError(DataPlaneError, ValueError):
    """A multi-turn episode could not go on: the environment failed or returned something unusable."""


def check_config(cfg, task) -> None:
    """A multi-turn task needs a total length limit: observations make the trajectory's length open-ended."""
    if cfg.policy.max_total_sequence_length is None:
        from dataplane_rl.errors import ConfigError

        raise ConfigError(f"task.name={task.name} is a multi-turn task and needs policy.max_total_sequence_length (the "
                          "limit on prompt + every turn + every observation); set it, e.g. "
                          "policy.max_total_sequence_length=64")


def turn_seed(seed: int, turn: int) -> int:
    """The sample's seed for policy turn `turn` (1-based); turn 1 uses the sample's own seed, so a first
    turn samples what a single-turn rollout of the same prompt would."""
    if turn == 1:
        return seed
    digest = hashlib.blake2b(f"{seed}/turn{turn}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") & ((1 << 63) - 1)


@dataclass
class Episode:
    """One trajectory being built; the lists grow together, one entry per token."""

    prompt: str
    row: int
    seed: int
    ids: list[int]
    mask: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    turn: list[int] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)  # token_policy_version: -1 but on sampled tokens
    actions: list[str] = field(default_factory=list)
    inputs: list[tuple[int, ...]] = field(default_factory=list)   # each turn's engine input, as given
    outputs: list[list[int]] = field(default_factory=list)        # each turn's sampled tokens
    observations: list[list[int]] = field(default_factory=list)   # each turn's appended observation tokens
    end: str | None = None
    reward: float = 0.0
    failure: object = None  # a DataFailure of the environment: the episode ends, its group fails (rollout/retries.py)

    def __post_init__(self) -> None:
        self.mask = [0] * len(self.ids)
        self.logprobs = [0.0] * len(self.ids)
        self.turn = [0] * len(self.ids)
        self.versions = [-1] * len(self.ids)

    def add(self, tokens: list[int], logprobs: list[float] | None, k: int, versions: list[int] | None = None) -> None:
        """Append sampled tokens (logprobs and versions given) or an observation's (None: masked, version -1)."""
        self.ids += tokens
        self.mask += [1 if logprobs is not None else 0] * len(tokens)
        self.logprobs += list(logprobs) if logprobs is not None else [0.0] * len(tokens)
        self.turn += [k] * len(tokens)
        self.versions += list(versions) if versions is not None else [-1] * len(tokens)


class Env:
    """The task's environment, called with the error handling a bad one needs: every failure names task, turn
    and row (and partition), in one line."""

    def __init__(self, task, tokenizer, pid: str, retries: Retries | None = None, eos: tuple[int, ...] | None = None) -> None:
        self.task, self.tokenizer, self.pid = task, tokenizer, pid
        self.retries = retries if retries is not None else Retries(0)
        self.unk = getattr(tokenizer, "unk_token_id", None)
        self.eos = eos if eos is not None else (tokenizer.eos_token_id,)  # the engine's (model/load.py eos_token_ids)

    def fail(self, ep: Episode, k: int, what: str) -> EpisodeError:
        what = " ".join(what.split())  # one line, whatever the environment put in its message
        return EpisodeError(f"task '{self.task.name}' turn {k} row {ep.row} (partition {self.pid}): {what}; nothing of "
                            "this rollout job was stored")

    def step(self, ep: Episode, k: int):
        # an exception is retried (the call is pure: the same actions each time), then DataFailure fails the group
        res = self.retries.call("environment", self.task.step, ep.prompt, list(ep.actions))
        obs, done, reward = (getattr(res, a, None) for a in ("observation", "done", "reward"))
        if not isinstance(obs, str):
            raise self.fail(ep, k, f"the environment returned observation {obs!r} ({type(obs).__name__}); it must be "
                                   "a string (an EnvStep(observation, done, reward))")
        if not isinstance(done, bool):
            raise self.fail(ep, k, f"the environment returned done={done!r}; it must be true or false")
        if isinstance(reward, bool) or not isinstance(reward, (int, float)) or not math.isfinite(reward):
            raise self.fail(ep, k, f"the environment returned reward {reward!r}; it must be a finite number")
        if not done and not obs:
            raise self.fail(ep, k, "the environment returned an empty observation but the episode is not done; "
                                   "return some text to show the policy, or done=True")
        return obs, done, float(reward)

    def encode(self, ep: Episode, k: int, obs: str) -> list[int]:
        if not obs:
            return []
        try:
            ids = list(self.tokenizer(obs, add_special_tokens=False).input_ids)
        except Exception as e:  # noqa: BLE001 - a tokenizer's own error, named with the observation
            raise self.fail(ep, k, f"observation {obs[:40]!r} cannot be tokenized ({type(e).__name__}: {e})") from None
        if not ids or (self.unk is not None and self.unk in ids):
            raise self.fail(ep, k, f"observation {obs[:40]!r} holds text the tokenizer cannot encode (it maps to the "
                                   "unknown token); use characters of the model's vocabulary")
        return ids


def run_episodes(engine, env: Env, episodes: list[Episode], *, max_turns: int, max_new_tokens: int,
                 max_total: int, temperature: float, top_k: int, top_p: float, versions=None) -> list[Episode]:
    """Play every episode to its end, all live episodes in one engine batch per turn. versions: a Generation's
    per-token weight versions (RolloutWorker.token_versions with the job's version bound); None: all 0."""
    versions = versions or (lambda g: [0] * len(g.tokens))
    for k in range(1, max_turns + 1):
        live = [e for e in episodes if e.end is None]
        for e in live:
            if len(e.ids) >= max_total:  # an observation filled the sequence exactly: no room for a turn
                e.end = "length"
        live = [e for e in live if e.end is None]
        if not live:
            break
        rooms = [min(max_new_tokens, max_total - len(e.ids)) for e in live]
        inputs = [tuple(e.ids) for e in live]
        gens: list[Generation] = engine.generate([list(i) for i in inputs], [turn_seed(e.seed, k) for e in live],
                                                 max(rooms), temperature, top_k, top_p)
        for e, g, room, inp in zip(live, gens, rooms, inputs):
            cut = len(g.tokens) > room
            tokens, lps = g.tokens[:room], g.logprobs[:room]
            e.inputs.append(inp)
            e.outputs.append(list(tokens))
            e.add(list(tokens), lps, k, versions(g)[:room])
            e.actions.append(env.tokenizer.decode(tokens, skip_special_tokens=True))
            try:
                obs, done, e.reward = env.step(e, k)
            except DataFailure as f:  # its group fails: the job drops the group's rows
                e.failure, e.end = f, "error"
                e.observations.append([])
                continue
            obs_ids = env.encode(e, k, obs)
            # cut by the length limit: more tokens than room, or exactly room < max_new_tokens without an eos
            cut = cut or (len(tokens) == room < max_new_tokens and not (tokens and tokens[-1] in env.eos))
            if cut:
                e.observations.append([])
                e.end = "length"
                continue
            space = max_total - len(e.ids)
            e.observations.append(obs_ids[:space])
            e.add(obs_ids[:space], None, k)
            if len(obs_ids) > space:
                e.end = "length"
            elif done:
                e.end = "done"
            elif k == max_turns:
                e.end = "max_turns"
    return episodes


def check_prefix(env: Env, e: Episode) -> None:
    """Token in, token out: every turn's engine input is the previous input plus its output plus the
    observation, and a prefix of the stored tokens; stored = prompt + sampled + observation tokens."""
    k_last = len(e.inputs)
    for k, inp in enumerate(e.inputs, 1):
        if list(inp) != e.ids[:len(inp)]:
            raise env.fail(e, k, "the engine's input for this turn is not a prefix of the stored trajectory "
                                 "(the history was re-rendered); the row is not written")
        if k < k_last and len(e.inputs[k]) != len(inp) + len(e.outputs[k - 1]) + len(e.observations[k - 1]):
            raise env.fail(e, k + 1, "the engine's input is not the previous turn's input + its output + the "
                                     "observation; the row is not written")
    if e.inputs:
        n = len(e.inputs[0]) + sum(len(o) for o in e.outputs) + sum(len(o) for o in e.observations)
        if n != len(e.ids):
            raise env.fail(e, k_last, f"the trajectory holds {len(e.ids)} tokens, the prompt, turns and observations "
                                      f"{n}; the row is not written")


def episode_columns(episodes: list[Episode], group_ids: list[int], prompt_len: list[int], tokenizer, version: int,
                    env: Env) -> pa.Table:
    # a row's generation_policy_version is its oldest sampled token's (`version`, the job's, if it sampled none)
    """The rollout writer's columns of finished episodes, in their order (prompt-major, then sample)."""
    for e in episodes:
        check_prefix(env, e)
    return schema_table(GRPO_SCHEMA, {  # the Arrow types are the schema's; token columns one sequence per row
        "input_ids": [e.ids for e in episodes],
        "input_lengths": [len(e.ids) for e in episodes],
        "token_mask": [e.mask for e in episodes],
        "generation_logprobs": [e.logprobs for e in episodes],
        "total_reward": [e.reward for e in episodes],
        "group_id": group_ids,
        "truncated": [e.end == "length" for e in episodes],
        "turn_index": [e.turn for e in episodes],
        "num_turns": [len(e.outputs) for e in episodes],
        "observation_tokens": [sum(map(len, e.observations)) for e in episodes],
        "end_reason": [e.end for e in episodes],
        "prompt_text": [e.prompt for e in episodes],
        "response_text": [response_text(tokenizer, e, p) for e, p in zip(episodes, prompt_len)],
        "generation_policy_version": [min((v for v in e.versions if v >= 0), default=version) for e in episodes],
        "token_policy_version": [e.versions for e in episodes],
    })


def multi_turn_table(worker, job, prompt_ids: list[list[int]], texts: list[str], seeds: list[int], G: int, temperature: float,
                     top_k: int, top_p: float, retries: Retries | None = None, version: int = 0) -> pa.Table:
    """A rollout job of a multi-turn task on `worker` (a RolloutWorker): G episodes per prompt, as columns."""
    cfg = worker.cfg
    check_config(cfg, worker.task)
    env = Env(worker.task, worker.tokenizer, job.pid, retries, getattr(worker.engine, "eos", None))
    episodes = [Episode(prompt, job.row_start + p_i * G + s, seeds[p_i * G + s], list(prompt_ids[p_i]))
                for p_i, prompt in enumerate(texts) for s in range(G)]
    run_episodes(worker.engine, env, episodes, max_turns=cfg.multi_turn.max_turns,
                 max_new_tokens=cfg.generation.max_new_tokens, max_total=cfg.policy.max_total_sequence_length,
                 temperature=temperature, top_k=top_k, top_p=top_p,
                 versions=lambda g: worker.token_versions(g, version))
    plen = [len(p) for p in prompt_ids for _ in range(G)]
    extras = ["{}"] * len(episodes)
    if getattr(worker.task, "user_reward", None) is not None:  # task.reward_function scores the ended episode
        for i, (e, p) in enumerate(zip(episodes, plen)):
            if e.failure is None:  # retried like the environment's calls; a reward that keeps failing fails the group
                try:
                    e.reward, extra = env.retries.call("reward", worker.task.score, e.prompt,
                                                       response_text(worker.tokenizer, e, p))
                    extras[i] = to_json(extra)
                except DataFailure as f:
                    e.failure = f
    groups = [gid for gid in job.group_ids for _ in range(G)]
    for e, gid in zip(episodes, groups):
        if e.failure is not None:
            env.retries.fail(gid, e.failure)
    table = episode_columns(episodes, groups, plen, worker.tokenizer, version, env)
    table = table.append_column("reward_extra_info", pa.array(extras, pa.string()))
    for name, col in row_columns(worker.task, job.prompts, G).items():
        table = table.append_column(name, col)
    return table


def response_text(tokenizer, e: Episode, prompt_len: int) -> str:
    """An episode's response_text: every turn and observation after the prompt, decoded."""
    return tokenizer.decode(e.ids[prompt_len:], skip_special_tokens=True)


def episode_metrics(scalars: pa.Table, policy_tokens: float) -> dict:
    """rollout/* metrics of a step's trained rows from their per-sample columns (names after verl's num_turns and
    NeMo-RL's termination rates); `policy_tokens`: the rows' sampled tokens (sum of token_mask)."""
    from dataplane_rl.store import to_numpy

    turns = to_numpy(scalars.column("num_turns")).astype(np.float64)  # [n]
    obs = to_numpy(scalars.column("observation_tokens")).astype(np.float64)  # [n]
    end = np.asarray(scalars.column("end_reason").to_pylist())  # [n]
    after_prompt = policy_tokens + float(obs.sum())
    return {
        "rollout/num_turns_mean": float(turns.mean()),
        "rollout/num_turns_max": int(turns.max()),
        "rollout/env_tokens_mean": float(obs.mean()),
        "rollout/policy_token_fraction": policy_tokens / after_prompt if after_prompt else 1.0,
        "rollout/natural_termination_rate": float((end == "done").mean()),
        "rollout/max_turns_reached_rate": float((end == "max_turns").mean()),
        "rollout/truncation_rate": float((end == "length").mean()),
    }
