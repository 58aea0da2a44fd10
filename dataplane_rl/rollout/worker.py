"""The rollout actor: generate and score its rows, then write them to the store or return them."""

from __future__ import annotations

import contextlib
import io
import os
import sys
import time
from dataclasses import dataclass

import numpy as np
import pyarrow as pa

from dataplane_rl import trace
from dataplane_rl.rollout.generation import Generation
from dataplane_rl.rollout.retries import Retries, score_job
from dataplane_rl.schema import GRPO_SCHEMA
from dataplane_rl.store import schema_table
from dataplane_rl.tasks import row_columns
from dataplane_rl.tasks.prompts import encode_prompt, prompt_ids, prompt_limit, truncate  # noqa: F401 (encode_prompt: API)
from dataplane_rl.tasks.multiturn import is_multi_turn


@dataclass
class RolloutJob:
    """Rows [row_start, row_start + len(prompt_ids) * G) of partition `pid`, whole groups."""

    pid: str
    step: int
    round: int
    row_start: int
    group_ids: list[int]       # one per prompt (the prompt's index in the round)
    prompts: list              # the task's prompt keys: dataset row ids, or prompt texts
    validation: bool = False   # held-out prompts: 1 sample each at generation.val_temperature
    retry: bool = False        # sent again after an actor died: write only the cells not yet committed
    weights: int = 0           # the version of the last refit sent before it: with in-flight updates it waits for it


@dataclass
class Pending:
    """One generation round in flight: partition `pid`, its jobs and their Ray futures."""

    pid: str
    step: int
    G: int
    jobs: list[RolloutJob]     # job i runs on rollout actor i
    futures: list
    version: int = 0           # the weights the jobs were sent after (faults/rollout_actors.py sends them again with these)


def rollout_columns(job: RolloutJob, gens, prompt_ids, texts: list[str], tokenizer, task, G: int, version: int,
                    retries: Retries, versions: list | None = None) -> pa.Table:
    """The rollout writer's columns for a job, in row order (prompt-major, then sample). Token columns are
    built flat (one values array and the row lengths per column, no numpy array per row): a put of per-row
    arrays cost ~25 µs per column per put more (docs/benchmarks.md, "Store throughput"). versions: per
    generation, the weight version of each of its tokens (RolloutWorker.token_versions); None: all `version`,
    the job's. A row's generation_policy_version is its oldest token's (`version` if it has none)."""
    versions = versions if versions is not None else [[version] * len(g.tokens) for g in gens]
    ids, glp, tpv, lengths, plens = [], [], [], [], []
    responses = [tokenizer.decode(g.tokens, skip_special_tokens=True) for g in gens]
    for p_i in range(len(job.prompts)):
        p = prompt_ids[p_i]
        for s in range(G):
            g = gens[p_i * G + s]
            ids += p
            ids += g.tokens
            glp += [0.0] * len(p)
            glp += g.logprobs
            tpv += [-1] * len(p)
            tpv += versions[p_i * G + s]
            plens.append(len(p))
            lengths.append(len(p) + len(g.tokens))
    rewards, extras = score_job(task, job.prompts, job.group_ids, responses, G, retries)
    trunc = [g.truncated for g in gens]
    n = np.asarray(lengths, np.int32)  # [B]
    pl = np.asarray(plens, np.int64)  # [B]
    # token_mask: per row, 0 over the prompt then 1 over the response, as one repeat of [0, 1] x B
    mask = np.repeat(np.tile(np.array([0, 1], np.int8), len(n)), np.stack([pl, n - pl], axis=1).ravel())  # [T]

    return schema_table(GRPO_SCHEMA, {  # the Arrow types are the schema's
        "input_ids": ids,
        "input_lengths": n,
        "token_mask": mask,
        "generation_logprobs": glp,
        "total_reward": rewards,
        "group_id": np.repeat(np.asarray(job.group_ids, np.int64), G),
        "truncated": trunc,
        # a single turn: the prompt is turn 0, the response turn 1; no observations
        "turn_index": mask,
        "num_turns": np.ones(len(n)),
        "observation_tokens": np.zeros(len(n)),
        "end_reason": ["length" if t else "done" for t in trunc],
        "prompt_text": [t for t in texts for _ in range(G)],
        "response_text": responses,
        "generation_policy_version": [min(v, default=version) for v in versions],
        "token_policy_version": tpv,
        "reward_extra_info": extras,
        **row_columns(task, job.prompts, G),  # data_source, extra_info, ground_truth, dataset_row
    }, lengths=n)


USER_STDOUT = "rollout_stdout.log"


class UserStdout(io.TextIOBase):
    """Where print() in a rollout job goes (a reward function, a task, an environment): RUN_DIR/rollout_stdout.log,
    made at the first line and appended a line at a time. Ray carries an actor's stdout to the CLI's stdout, which
    holds the run's summary line alone (`| jq`); on a host without the run folder, to stderr."""

    def __init__(self, run_dir: str | None) -> None:
        self.path = os.path.join(run_dir, USER_STDOUT) if run_dir and os.path.isdir(run_dir) else None
        self.file = None

    def write(self, text: str) -> int:
        if self.path is None:
            return sys.stderr.write(text)
        if self.file is None:
            self.file = open(self.path, "a", buffering=1, encoding="utf-8")
        return self.file.write(text)

    def flush(self) -> None:
        (self.file or sys.stderr).flush()

    def close(self) -> None:
        if self.file is not None:
            self.file.close()
            self.file = None
        super().close()


def response_rooms(prompt_ids: list[list[int]], max_new_tokens: int, max_total: int | None) -> list[int]:
    """Most response tokens per prompt: generation.max_new_tokens, less where prompt + response would
    exceed policy.max_total_sequence_length."""
    if max_total is None:
        return [max_new_tokens] * len(prompt_ids)
    rooms = [min(max_new_tokens, max_total - len(p)) for p in prompt_ids]
    if rooms and min(rooms) < 1:
        longest = max(len(p) for p in prompt_ids)
        from dataplane_rl.errors import ConfigError

        raise ConfigError(f"a prompt of {longest} tokens leaves no room for a response within "
                          f"policy.max_total_sequence_length={max_total}; raise it above the longest prompt")
    return rooms


def cut(g: Generation, room: int) -> Generation:
    """The generation cut to `room` tokens; a cut one is truncated (it did not end by itself)."""
    if len(g.tokens) <= room:
        return g
    return Generation(g.tokens[:room], g.logprobs[:room], truncated=True,
                      versions=None if g.versions is None else g.versions[:room])


class RolloutWorker:
    """One Ray actor: an engine, the task's reward function and (data plane on) a store client."""

    def __init__(self, cfg: dict, model_folder: str, store_url: str | None, threads: int) -> None:
        import torch

        from dataplane_rl.config import Config
        from dataplane_rl.rollout.engine import make_engine
        from dataplane_rl.tasks import load_task
        from dataplane_rl.model.load import load_tokenizer

        self.set_threads = torch.set_num_threads  # torch's own: vLLM's CPU worker replaces it with a no-op
        self.set_threads(threads)
        self.cfg = Config.model_validate(cfg)
        self.tokenizer = load_tokenizer(model_folder)
        self.engine = make_engine(self.cfg, model_folder, self.tokenizer)
        self.threads = torch.get_num_threads()  # as the engine left them (vLLM binds them)
        # task.module imported here, in this actor; a dataset mapped, not scanned: the driver draws the rows
        self.task = load_task(self.cfg.task, self.tokenizer, draws=False)
        self.prompt_limit = prompt_limit(self.cfg, model_folder)
        from dataplane_rl.columns.actor_io import ActorIO

        self.io = ActorIO(store_url)
        self.in_flight = self.cfg.grpo.async_grpo.in_flight_weight_updates
        self._version = 0  # the last refit's step (with in-flight updates the engine keeps it: `version`)
        self.stdout = UserStdout(self.cfg.logger.run_dir)
        trace.configure(self.cfg.logger.trace_max_events > 0)

    def ready(self) -> int:
        return os.getpid()

    @property
    def version(self) -> int:
        """The weights' version now: the last training step whose weights the engine loaded (0: the initial)."""
        return self.engine.slot.version if self.in_flight else self._version

    @trace.traced("load_weights")
    def load_weights(self, state_dict, version: int) -> float:
        """Refit the engine with the policy's weights after training step `version`; returns the seconds
        the engine took. Without in-flight updates the actor runs one call at a time, so a refit lands between
        generation batches; with them (InFlightRolloutWorker) it may run while `generate` does, and then
        waits in the engine's slot for the next decode step (0 s here, its load counted in the generation)."""
        t0 = time.perf_counter()
        if self.in_flight:
            self.engine.slot.offer(state_dict, version)
        else:
            self.engine.load_weights(state_dict)
            self._version = version
        return time.perf_counter() - t0

    def token_versions(self, g: Generation, version: int) -> list[int]:
        """The weight version of each of g's tokens: the engine's record with in-flight updates, else `version`
        (the job's, which no refit can change while it runs)."""
        if self.in_flight and g.versions is not None:
            return list(g.versions)
        return [version] * len(g.tokens)

    def rng_state(self) -> dict:
        from dataplane_rl.rng import RNGState

        return RNGState().state_dict()

    def set_rng_state(self, state: dict | None) -> None:
        """Restore a checkpoint's RNG state (None: the checkpoint had no actor in this slot; keep the seeded one)."""
        from dataplane_rl.rng import RNGState

        if state is not None:
            RNGState().load_state_dict(state)

    def encode(self, key) -> list[int]:
        return self.prompt(key)[0]

    def prompt(self, key) -> tuple[list[int], str]:
        """Prompt `key`'s token ids as the engine gets them, and its text; an overlong prompt cut as
        task.truncation says (the driver refused or replaced it for truncation=error or a filter)."""
        ids, text = prompt_ids(self.task, key, self.tokenizer, self.cfg.task.apply_chat_template)
        cut = truncate(ids, self.prompt_limit, self.cfg.task.truncation)
        return cut, text if cut is ids else self.tokenizer.decode(cut, skip_special_tokens=True)

    @trace.traced("rollout_job")
    def generate(self, job: RolloutJob):
        """Generate G samples per prompt of the job with the current weights; returns (table, receipt):
        the table is None when the data plane put it, else the driver holds the columns."""
        with contextlib.redirect_stdout(self.stdout):  # the user code's print(): the run folder's log (UserStdout)
            return self.run_job(job)

    def run_job(self, job: RolloutJob):
        from dataplane_rl.rollout.generation import sample_seed

        gen, G, seed = self.cfg.generation, self.cfg.grpo.num_generations_per_prompt, self.cfg.grpo.seed
        temperature, top_k, top_p = gen.temperature, gen.top_k, gen.top_p
        if job.validation:
            # top_k/top_p mean nothing to greedy decoding; 0 and 1 keep vLLM's log-prob mode check quiet
            G, temperature = 1, gen.val_temperature
            if temperature == 0:
                top_k, top_p = 0, 1.0
        t0 = time.perf_counter()
        wait_s = self.cfg.grpo.async_grpo.wait_timeout_s
        if self.in_flight and not self.engine.slot.wait_for_version(job.weights, wait_s):
            raise RuntimeError(f"rollout job step {job.step} round {job.round}: the refit to version {job.weights} sent "
                               f"before it did not reach this actor within grpo.async_grpo.wait_timeout_s="
                               f"{wait_s}; the engine holds version {self.version}")
        version = self.version  # the job's first token's; with in-flight updates later ones may be newer
        refits = self.engine.slot.in_flight_refits if self.in_flight else 0
        encoded = [self.prompt(p) for p in job.prompts]
        prompt_ids, texts = [e[0] for e in encoded], [e[1] for e in encoded]
        flat = [p for p in prompt_ids for _ in range(G)]
        # validation rounds use round -1: their seeds never coincide with a training sample's
        seeds = [sample_seed(seed, job.step, -1 if job.validation else job.round, gid, s)
                 for gid in job.group_ids for s in range(G)]
        rooms = response_rooms(prompt_ids, gen.max_new_tokens, self.cfg.policy.max_total_sequence_length)
        retries = Retries(self.cfg.fault_tolerance.max_data_retries)
        if is_multi_turn(self.task):
            from dataplane_rl.rollout.multiturn import multi_turn_table

            table = multi_turn_table(self, job, prompt_ids, texts, seeds, G, temperature, top_k, top_p, retries,
                                     version)
        else:
            gens = self.engine.generate(flat, seeds, max(rooms), temperature, top_k, top_p)
            gens = [cut(g, rooms[i // G]) for i, g in enumerate(gens)]
            table = rollout_columns(job, gens, prompt_ids, texts, self.tokenizer, self.task, G, version, retries,
                                    [self.token_versions(g, version) for g in gens])
        table, rows, failures = retries.drop_failed(table, np.arange(job.row_start, job.row_start + table.num_rows))
        receipt = {"rows": table.num_rows, "generate_s": time.perf_counter() - t0, "version": version, **failures}
        if self.in_flight:  # refits that landed inside this job's generation (async/in_flight_refits)
            receipt["in_flight_refits"] = self.engine.slot.in_flight_refits - refits
        trace.complete("generate", t0, step=job.step, round=job.round, rows=table.num_rows, validation=job.validation)
        if job.retry:
            table, receipt["rows_regenerated"] = self.io.emit_missing(job.pid, rows, table)
        else:
            table = self.io.emit([(job.pid, rows)], table)
        receipt.update(self.io.take(), trace=trace.take())
        return table, receipt

    def reopen_store(self, url: str | None) -> None:
        """Open the run's store again at `url` (the driver replaced a store that lost a holder: faults/restart.py).
        The old client is dropped without close(): its master may be gone, and the client's close would wait on it."""
        from dataplane_rl.columns.actor_io import ActorIO

        self.io = ActorIO(url)

    def close(self) -> list[dict]:
        """Close the store client and the user code's log; returns the trace events not yet taken."""
        self.io.close()
        self.stdout.close()
        return trace.take()


def actor_class(in_flight: bool):
    """The Ray actor class of a rollout actor. With in-flight weight updates, load_weights runs in its own
    concurrency group (one thread) beside the default group's (one thread: generate and the rest stay serial and
    in order), so a refit reaches the engine while it generates; without them, a plain one-call-at-a-time actor."""
    import ray

    if not in_flight:
        return ray.remote(RolloutWorker)

    class InFlightRolloutWorker(RolloutWorker):
        def generate(self, job: RolloutJob):
            # a threaded actor runs this on its default group's thread, not __init__'s: OpenMP's thread count is
            # per thread (Ray gives others OMP_NUM_THREADS=1), and vLLM's CPU attention checks it against its own
            self.set_threads(self.threads)
            return super().generate(job)

        @ray.method(concurrency_group="refit")
        def load_weights(self, state_dict, version: int) -> float:
            return super().load_weights(state_dict, version)

    return ray.remote(concurrency_groups={"refit": 1})(InFlightRolloutWorker)
