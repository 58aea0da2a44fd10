"""GRPO's step as functions of (fleet, progress, step), the same phases for sync and async GRPO (docs/architecture.md §4).

Sync and async differ only in where `collect_groups` finds a step's rollout partition (generated on demand, or
sent ahead: driver/rollouts.py) and in whether `refit_phase` waits for the rollout actors. The data plane
on/off switch is driver/transport.py; the processes are the Fleet's (driver/fleet.py), what the steps have done
is the run's Progress (run/progress.py), which only the step and the fleet's refits write.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

import numpy as np
import pyarrow as pa

from dataplane_rl import trace
from dataplane_rl.algorithms.grpo import advantages, informative_groups
from dataplane_rl.columns.rowsets import RowSet, fetch, merge, rowset_size, save_parquet, select, shard_balanced, write
from dataplane_rl.errors import StoreUnavailableError
from dataplane_rl.store import to_numpy
from dataplane_rl.train.packing import balance_by_tokens, refuse_over_budget
from dataplane_rl.faults.store import dead_store
from dataplane_rl.driver.rollouts import fresh_groups
from dataplane_rl.driver.samples import train_data_rows
from dataplane_rl.driver.step_io import DynamicSamplingError, Groups, StepIO
from dataplane_rl.driver.replay import ReplayBuffer, admitted, fresh_shards
from dataplane_rl.driver.step_metrics import step_metrics
from dataplane_rl.run.progress import Progress


def grpo_step(fleet, progress: Progress, step: int, rollouts_dir: Path | None = None) -> tuple[dict, list[dict]]:
    """One GRPO step on `fleet`, sync or async alike: its metrics line and its train_data/ rows. `progress`: the
    run's record the fleet was made with; rollouts_dir: where each step's rows go as a parquet file
    (logger.save_rollouts; None: nowhere)."""
    cfg, io = fleet.cfg, StepIO()
    progress.in_step = step  # the step under way, for the faults a recovery records
    progress.trained = False  # until the optimizer steps: a lost store can still be regenerated (faults/restart.py)
    t_step = time.perf_counter()
    replay = progress.replay  # the group replay buffer (driver/replay.py); None: grpo.replay is off
    if replay is not None:
        replay.begin_step()
    got = collect_groups(fleet, step, io, replay, progress.version)
    if cfg.grpo.async_grpo.in_flight_weight_updates:  # async/token_age_* and mixed_version_samples
        got.token_versions = read(fleet, got.rs, ["token_policy_version"], io).column(0).combine_chunks()
    rewards = advantages_and_masks(fleet, cfg, got, io)
    # the run folder's rows are read before the optimizer steps: after them the step needs nothing from the
    # store, so a store lost then costs nothing of the step (faults/restart.py; `prev_from_train`)
    samples = train_data(fleet, got.rs, io)
    per_rank_steps = shard(fleet, cfg, got)
    logprobs(fleet, cfg, per_rank_steps if not got.reused else fresh_shards(got, cfg.policy.dp_size), io)
    if rollouts_dir is not None and fleet.prev_pass:
        save_parquet(fleet.store, got.rs, rollouts_dir / f"step_{step:06d}.parquet")
    train = train_policy(fleet, cfg, per_rank_steps, io)
    progress.trained = True
    if not fleet.prev_pass:
        prev_from_train(fleet, step, got.rs, per_rank_steps, io, rollouts_dir)
    progress.version = step
    refit_phase(fleet, progress, io)
    done = got.pids
    if replay is not None:  # the step's informative groups kept by reference; their partitions stay pinned
        replay.admit(admitted(got, step))
        done = sorted((set(done) | set(replay.evict(step))) - replay.pinned())
        rewards = to_numpy(got.scalars.column("total_reward")).astype(np.float64)  # every trained group's
    if not cfg.data_plane.keep_partitions:
        drop(fleet, done)
    io.timing["step"] = time.perf_counter() - t_step
    metrics = log(fleet, progress, step, train, got, rewards, io)
    if replay is not None:
        metrics.update(replay.metrics())
        metrics["replay/fresh_groups"] = len(got.groups)
    return metrics, samples


@trace.traced("collect_groups")
def collect_groups(fleet, step: int, io: StepIO, replay: ReplayBuffer | None = None, version: int = 0) -> Groups:
    """Whole groups for the step: the step's round partition (sent ahead in async mode), then, with
    dynamic sampling or stale rows, more rounds with the current weights until P groups are kept.
    A group is kept only if it is informative (dynamic sampling) and every row's version is at least
    step-1-age (async; sync rows are always version step-1). With the replay buffer, groups it replays for
    weights `version` take part of the P places first (and, with dynamic sampling, those a round left out) and
    the rounds generate only the rest."""
    g = fleet.cfg.grpo
    P = g.num_prompts_per_step
    reused = replay.take(P - replay.fresh_groups(P), version) if replay is not None else []
    want = P - len(reused)  # the groups the rounds generate
    oldest = step - 1 - (fleet.rollouts.ahead or 0)
    kept: list = []  # (pid, rows of one whole group)
    scalars: dict[str, pa.Table] = {}  # per round partition: its DRIVER_FIELDS on its written rows, read once
    written: dict[str, np.ndarray] = {}  # per round partition: those rows (not a failed group's)
    rounds_rewards, rounds_sources, dropped, refits = [], [], 0, 0
    generated = flat = round_ = 0
    rounds = g.max_gen_batches if g.use_dynamic_sampling or fleet.rollouts.ahead else 1
    while round_ < rounds:
        p = fleet.rollouts.first_round(step, want) if round_ == 0 else fleet.rollouts.send_round(step, round_, want)
        receipts = fleet.rollouts.collect(p, io)
        io.timing["generate"] = io.timing.get("generate", 0.0) + max(r["generate_s"] for r in receipts)
        refits += sum(r.get("in_flight_refits", 0) for r in receipts)
        sc, rows = fleet.rollouts.read(step, p, receipts, fleet.schema.field_set("DRIVER_FIELDS"), io)
        scalars[p.pid], written[p.pid] = sc, rows
        if len(rows) < p.G * sum(len(j.prompts) for j in p.jobs):  # failed groups: one more round may replace them
            rounds = max(rounds, min(round_ + 2, g.max_gen_batches))
        round_ += 1
        rewards = to_numpy(sc.column("total_reward")).astype(np.float64)
        groups = to_numpy(sc.column("group_id"))
        rounds_rewards.append(rewards)
        rounds_sources += sc.column("data_source").to_pylist()
        uniq = np.unique(groups)
        generated += len(uniq)
        flat += len(uniq) - len(informative_groups(rewards, groups))
        keep, stale = fresh_groups(to_numpy(sc.column("generation_policy_version")), groups, oldest)
        dropped += stale
        if g.use_dynamic_sampling:
            keep = np.intersect1d(keep, informative_groups(rewards, groups))
        for gid in keep:
            if len(kept) < want:
                kept.append((p.pid, rows[groups == gid]))
        if (replay is not None and g.use_dynamic_sampling and len(kept) < want
                and len(kept) * g.num_generations_per_prompt >= fleet.cfg.policy.dp_size):  # each rank scores a new row
            extra = replay.take(want - len(kept), version)  # in place of groups left out for equal rewards
            reused, want = reused + extra, want - len(extra)
        if len(kept) >= want:
            break
    if len(kept) < want:
        drop(fleet, list(scalars))
        raise DynamicSamplingError(
            f"step {step}: kept {len(kept) + len(reused)} of {P} groups (non-equal rewards with grpo.use_dynamic_sampling, "
            f"versions >= {oldest} with grpo.async_grpo; {dropped} stale rows dropped) after {len(scalars)} "
            f"rounds (grpo.max_gen_batches={g.max_gen_batches}); raise grpo.max_gen_batches, lower "
            "grpo.num_prompts_per_step, or turn grpo.use_dynamic_sampling off")
    rs = merge([[k] for k in kept])  # the kept rows, whole groups in order, by partition
    sc = pa.concat_tables([scalars[pid].take(pa.array(np.searchsorted(written[pid], rows))) for pid, rows in rs])
    got = Groups(rs, sc, list(scalars), rounds_rewards, rounds_sources, dropped, generated, flat, refits, groups=kept)
    if reused:  # after the new groups: their rows, advantages and log-probs as the store holds them
        again = merge([[(e.pid, np.asarray(e.rows, np.int64))] for e in reused])
        got.fresh, got.reused = rs, reused
        got.rs = merge([rs, again])
        got.scalars = pa.concat_tables([sc, read(fleet, again, fleet.schema.field_set("DRIVER_FIELDS"), io)])
    return got


@trace.traced("advantages")
def advantages_and_masks(fleet, cfg, got: Groups, io: StepIO) -> np.ndarray:
    """Per-sample advantages and sample_mask, put as driver columns; returns the kept rewards."""
    g, rs = cfg.grpo, got.fresh if got.reused else got.rs  # a replayed group's cells are written already
    sc = got.scalars.slice(0, rowset_size(rs))
    rewards = to_numpy(sc.column("total_reward")).astype(np.float64)
    groups = to_numpy(sc.column("group_id"))
    # group ids repeat across rounds: make them unique per (round partition, group)
    seg = np.concatenate([np.full(len(rows), i) for i, (_, rows) in enumerate(rs)])
    unique_groups = seg * (g.num_prompts_per_step + 1) + groups
    adv = advantages(rewards, unique_groups, normalize=g.normalize_rewards, leave_one_out=g.use_leave_one_out_baseline)
    truncated = to_numpy(sc.column("truncated")).astype(bool)
    sample_mask = np.where(truncated & g.overlong_filtering, 0, 1).astype(np.int8)
    t0 = time.perf_counter()
    io.bytes_written += write(fleet.store, rs, pa.table({"advantages": pa.array(adv), "sample_mask": pa.array(sample_mask)}))
    io.put_s += time.perf_counter() - t0
    got.advantages = adv
    return rewards


def shard(fleet, cfg, got: Groups) -> list[list[RowSet]]:
    """Global batches in row-set order, each split over the ranks balanced by tokens: per rank, one
    row set per optimizer step."""
    lengths = to_numpy(got.scalars.column("input_lengths")).astype(np.int64)
    p = cfg.policy
    n, GB, D = rowset_size(got.rs), p.train_global_batch_size, p.dp_size
    budgets = p.token_budgets()
    refuse_over_budget(lengths, got.rs, p)
    # token budgets make the pass counts differ anyway (evened by empty passes): give rows by tokens only
    split = balance_by_tokens if budgets else shard_balanced
    per_rank: list[list[RowSet]] = [[] for _ in range(D)]
    for start in range(0, n, GB):
        pos = np.arange(start, min(start + GB, n))
        for r, shard in enumerate(split(lengths[pos], D)):
            per_rank[r].append(select(got.rs, pos[shard]))
    return per_rank


@trace.traced("logprobs")
def logprobs(fleet, cfg, per_rank_steps: list[list[RowSet]], io: StepIO) -> None:
    """prev_logprobs under the current weights (not on an exactly on-policy step: `prev_from_train`), the
    reference's and the teacher's, written as columns; no pass when none of them is needed."""
    t0 = time.perf_counter()
    if fleet.prev_pass or cfg.loss_fn.reference_policy_kl_penalty > 0 or cfg.distillation.enabled:
        fleet.send("logprobs", [merge(s) for s in per_rank_steps], fleet.schema.field_set("LOGPROB_SEED_FIELDS"))
    io.timing["logprobs"] = time.perf_counter() - t0


@trace.traced("train")
def train_policy(fleet, cfg, per_rank_steps: list[list[RowSet]], io: StepIO) -> dict:
    """The optimizer steps; returns rank 0's global metrics."""
    t0 = time.perf_counter()
    # an on-policy step's prev_logprobs are not written yet: its train forward gives them
    fields = [f for f in cfg.train_fields(fleet.schema) if fleet.prev_pass or f != "prev_logprobs"]
    results = fleet.send("train", per_rank_steps, fields)
    io.timing["train"] = time.perf_counter() - t0
    ranks_io(fleet, io)
    return results[0]


def ranks_io(fleet, io: StepIO) -> None:
    """The train ranks' data-plane traffic and trace events since they were last taken."""
    for r, receipt in enumerate(fleet.call_ranks("take_io")):
        io.add(receipt)
        trace.absorb(receipt.pop("trace", None), f"train-rank-{r}")


@trace.traced("prev_logprobs")
def prev_from_train(fleet, step: int, rs: RowSet, per_rank_steps: list[list[RowSet]], io: StepIO,
                    rollouts_dir: Path | None) -> None:
    """An exactly on-policy step's prev_logprobs, which its train forward gave, written as the policy's column, then
    the step's rollouts file (which holds them). After the optimizer step a lost store cannot be regenerated, but
    the step needs nothing more from it: as `drop`, the column and the file go with the store's rows, and the step
    goes on (the next store operation replaces the store: faults/restart.py)."""
    t0 = time.perf_counter()
    try:
        fleet.send("emit_prev_logprobs", [merge(s) for s in per_rank_steps])
        if rollouts_dir is not None:
            save_parquet(fleet.store, rs, rollouts_dir / f"step_{step:06d}.parquet")
    except Exception as e:  # noqa: BLE001 - a store error of a dead holder is survived; any other raises
        if not dead_store(fleet.store, e):
            raise
        print(f"step {step}: the run's store lost a process after the optimizer step; the step's prev_logprobs "
              "column and rollouts file went with its rows", file=sys.stderr, flush=True)
    ranks_io(fleet, io)
    io.timing["prev_logprobs"] = time.perf_counter() - t0


@trace.traced("refit")
def refit_phase(fleet, progress: Progress, io: StepIO) -> None:
    """Sync: the rollout actors load the new weights before the next step. Async: they load them after
    the batches in flight, and the steps those weights may generate are sent at once."""
    t0 = time.perf_counter()
    if fleet.rollouts.ahead is None:
        io.timing["refit_engine"] = fleet.refit()
    else:
        io.timing["refit_engine"] = fleet.refit(wait=False)  # earlier refits' errors surface here
        fleet.rollouts.send_ahead(progress.version)
    io.timing["refit"] = time.perf_counter() - t0


@trace.traced("train_data")
def train_data(fleet, rs: RowSet, io: StepIO) -> list[dict]:
    """The trained rows for the run folder's train_data/ file."""
    return train_data_rows(rs, read(fleet, rs, fleet.schema.field_set("TRAIN_DATA_FIELDS"), io))


def read(fleet, rs: RowSet, fields, io: StepIO) -> pa.Table:
    """Columns of the row set, read by the driver (data_plane/driver_bytes_read)."""
    t0 = time.perf_counter()
    data = fetch(fleet.store, rs, fields)
    io.driver_bytes_read += data.nbytes
    io.get_s += time.perf_counter() - t0
    return data


def drop(fleet, pids: list[str]) -> None:
    """Drop the step's partitions; with the run's Mooncake store lost, they went with it (the next store
    operation replaces the store: faults/restart.py)."""
    for pid in pids:
        try:
            fleet.store.drop_partition(pid)
        except StoreUnavailableError as e:
            if not dead_store(fleet.store, e):
                raise
            return


def log(fleet, progress: Progress, step: int, train: dict, got: Groups, kept_rewards: np.ndarray, io: StepIO) -> dict:
    """The step's metrics (driver/step_metrics.py)."""
    now = time.perf_counter()
    since = now - (progress.last_step_end if progress.last_step_end is not None else now - io.timing["step"])
    progress.last_step_end = now
    return step_metrics(step, train, got, kept_rewards, io, since=since, epochs=fleet.cfg.grpo.num_epochs,
                        async_on=fleet.rollouts.ahead is not None, data_plane=bool(fleet.store_address()),
                        counters={**fleet.ledger.counters(), **fleet.sampler.counters()})
