"""The group replay buffer (docs/grpo.md#group-replay): whole groups kept as references to their rows in the store.

An entry is (partition, rows of one whole group) and the tags it was admitted with; the rows themselves stay
where the rollout actors wrote them, immutable and checksummed, so a replayed group trains on exactly the cells
its first step trained on: its rewards, advantages, generation and prev log-probs and versions, read from the
store (cells are written once, so nothing of it can change). A partition an entry refers to is pinned: the step
that made it does not drop it, and it is dropped when its last entry is evicted (`evict` returns it).

Per step (sync GRPO, weights version v = step - 1): `take` replays up to the groups the step leaves to the buffer,
chosen by `grpo.replay.strategy` among the eligible ones (age v - version <= max_staleness, used fewer than
max_reuse times); the step generates the rest; `admit` adds the step's new informative groups; `evict` drops,
with the new weights, what can never be replayed again (too stale, reused up) and the oldest past capacity. The
state (entries, use counts, the strategy's RNG) is the checkpoint's (`state_dict`), with the pinned rows
(checkpoint/replay.py), so a resumed run replays the same groups as a straight one.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

import numpy as np

from dataplane_rl.columns.rowsets import rowset_size, select
from dataplane_rl.config.replay import ReplayConfig
from dataplane_rl.store import to_numpy
from dataplane_rl.train.packing import balance_by_tokens

REASONS = ("staleness", "reuse", "capacity")
PRIORITY_FLOOR = 1e-6  # a group whose mean |advantage| is 0 still has a chance under `priority`


@dataclass
class Entry:
    pid: str  # the partition that holds the group's rows
    rows: list[int]  # the group's rows there, all of them
    version: int  # the weights that generated it: its rows' oldest generation_policy_version
    step: int  # the step that admitted it (and trained it first)
    reward_mean: float
    reward_std: float
    advantage: float  # mean |advantage| over its rows: its priority
    source: str  # its data_source
    uses: int = 0  # times replayed so far
    seq: int = 0  # admission order (fifo, recency, capacity)


class ReplayBuffer:
    """Entries in admission order; `evicted` counts this step's evictions by reason (reset by `begin_step`)."""

    def __init__(self, cfg: ReplayConfig, seed: int) -> None:
        self.cfg = cfg
        self.entries: list[Entry] = []
        self.rng = np.random.default_rng([seed, 0x7265706C])  # its own stream: no other draw of the run moves it
        self.seq = 0
        self.evicted = dict.fromkeys(REASONS, 0)
        self.taken: list[tuple[Entry, int]] = []  # this step's replayed entries and their age

    def fresh_groups(self, num_prompts: int) -> int:
        """Groups a step generates at least (grpo.replay.fresh_fraction of them, rounded up)."""
        return min(num_prompts, math.ceil(num_prompts * self.cfg.fresh_fraction))

    def begin_step(self) -> None:
        self.evicted = dict.fromkeys(REASONS, 0)
        self.taken = []

    def eligible(self, version: int) -> list[Entry]:
        """Entries the weights `version` may replay: at most max_staleness versions old, used fewer than max_reuse times."""
        c = self.cfg
        return [e for e in self.entries if version - e.version <= c.max_staleness and e.uses < c.max_reuse]

    def take(self, n: int, version: int) -> list[Entry]:
        """Up to `n` eligible entries for a step training weights `version`, chosen by the strategy, in admission
        order; each one's use is counted. With difficulty pools (grpo.replay.easy_/hard_threshold), easy_fraction
        and hard_fraction of them come from the easy and hard pools and the rest from the groups between; places a
        pool cannot fill go to every eligible group left."""
        pool = self.eligible(version)
        n = min(n, len(pool))
        if n <= 0:
            return []
        c = self.cfg
        chosen: list[Entry] = []
        if c.easy_threshold is not None or c.hard_threshold is not None:
            k_easy, k_hard = round(n * c.easy_fraction), round(n * c.hard_fraction)
            for pool_name, k in (("easy", k_easy), ("hard", k_hard), ("between", n - k_easy - k_hard)):
                chosen += self.pick([e for e in pool if self.difficulty(e) == pool_name], k)
        taken = {id(e) for e in chosen}
        chosen += self.pick([e for e in pool if id(e) not in taken], n - len(chosen))
        chosen.sort(key=lambda e: e.seq)
        for e in chosen:
            e.uses += 1
            self.taken.append((e, version - e.version))
        return chosen

    def difficulty(self, e: Entry) -> str:
        """The entry's pool by its mean reward: easy, hard or between (the thresholds cannot overlap: config)."""
        c = self.cfg
        if c.easy_threshold is not None and e.reward_mean >= c.easy_threshold:
            return "easy"
        if c.hard_threshold is not None and e.reward_mean <= c.hard_threshold:
            return "hard"
        return "between"

    def pick(self, pool: list[Entry], n: int) -> list[Entry]:
        """Up to `n` of `pool` (in admission order) by the strategy."""
        n = min(n, len(pool))
        if n <= 0:
            return []
        s = self.cfg.strategy
        if s == "fifo":
            return pool[:n]
        if s == "recency":
            return pool[len(pool) - n:]
        w = None
        if s == "priority":
            w = np.array([max(e.advantage, PRIORITY_FLOOR) for e in pool], dtype=np.float64)
            w /= w.sum()
        return [pool[int(i)] for i in sorted(self.rng.choice(len(pool), size=n, replace=False, p=w))]

    def admit(self, entries: list[Entry]) -> None:
        for e in entries:
            e.seq, self.seq = self.seq, self.seq + 1
            self.entries.append(e)

    def evict(self, version: int) -> list[str]:
        """With weights `version` now trained: drop the entries no later step may replay (older than max_staleness
        for the next step, or replayed max_reuse times) and the oldest past capacity_groups; returns the partitions
        no entry refers to any more (the caller drops them from the store)."""
        c, before = self.cfg, self.pinned()
        keep = []
        for e in self.entries:
            if version - e.version > c.max_staleness:
                self.evicted["staleness"] += 1
            elif e.uses >= c.max_reuse:
                self.evicted["reuse"] += 1
            else:
                keep.append(e)
        over = len(keep) - c.capacity_groups
        if over > 0:
            self.evicted["capacity"] += over
            keep = keep[over:]
        self.entries = keep
        return sorted(before - self.pinned())

    def pinned(self) -> set[str]:
        """The partitions a live entry refers to: the store keeps them past their step."""
        return {e.pid for e in self.entries}

    def metrics(self) -> dict:
        """This step's replay/* metrics."""
        c = self.cfg
        ages = [age for _, age in self.taken]
        uses = [e.uses for e, _ in self.taken]
        m = {"replay/size_groups": len(self.entries), "replay/reused_groups": len(self.taken),
             "replay/evicted_groups": sum(self.evicted.values()), "replay/partitions": len(self.pinned()),
             "replay/staleness_mean": float(np.mean(ages)) if ages else 0.0,
             "replay/staleness_max": int(max(ages, default=0)),
             "replay/reuse_mean": float(np.mean(uses)) if uses else 0.0, "replay/reuse_max": int(max(uses, default=0))}
        m.update({f"replay/evicted_groups/{r}": n for r, n in self.evicted.items()})
        for pool_name, threshold in (("easy", c.easy_threshold), ("hard", c.hard_threshold)):
            if threshold is not None:
                m[f"replay/reused_{pool_name}_groups"] = sum(self.difficulty(e) == pool_name for e, _ in self.taken)
        return m

    # -- the checkpoint's part ------------------------------------------------------------------------
    def state_dict(self) -> dict:
        return {"entries": [asdict(e) for e in self.entries], "seq": self.seq, "rng": self.rng.bit_generator.state}

    def load_state_dict(self, state: dict) -> None:
        self.entries = [Entry(**e) for e in state["entries"]]
        self.seq = int(state["seq"])
        self.rng.bit_generator.state = state["rng"]
        self.begin_step()


# -- the step's side (driver/step.py) ---------------------------------------------------------------
def admitted(got, step: int) -> list[Entry]:
    """The step's new groups worth replaying, as entries: those whose rewards are not all equal (a group of equal
    rewards has zero advantages and teaches nothing twice). `got`: the step's Groups, advantages computed."""
    sc = got.scalars
    rewards = to_numpy(sc.column("total_reward")).astype(np.float64)  # [n] new rows first, in `groups` order
    versions = to_numpy(sc.column("generation_policy_version")).astype(np.int64)
    sources = sc.column("data_source").to_pylist()
    out, at = [], 0
    for pid, rows in got.groups:
        n = len(rows)
        r = rewards[at:at + n]
        if r.min() < r.max():
            out.append(Entry(pid, [int(x) for x in rows], int(versions[at:at + n].min()), step, float(r.mean()),
                             float(r.std()), float(np.abs(got.advantages[at:at + n]).mean()), str(sources[at])))
        at += n
    return out


def fresh_shards(got, ranks: int) -> list[list]:
    """The step's new rows over the train ranks, balanced by tokens, each rank at least one (config/models.py
    refuses a fraction that leaves fewer new rows than ranks): the log-prob pass scores only these, a replayed
    group's log-probs being in the store already."""
    lengths = to_numpy(got.scalars.column("input_lengths")).astype(np.int64)[:rowset_size(got.fresh)]
    return [[select(got.fresh, pos)] for pos in balance_by_tokens(lengths, ranks)]  # per rank: one row set
