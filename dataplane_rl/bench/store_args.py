"""`bench store`'s flags and their checks: every value is refused up front, in one line naming the flag, the
value and what it may be, before a process starts or a byte is made."""

from __future__ import annotations

import argparse

from dataplane_rl.bench.store_work import Workload, batch_bytes, group_ranges
from dataplane_rl.errors import ConfigError
from dataplane_rl.schema import MAX_INNER_VALUES

DEFAULT_BACKENDS = "shm,mooncake,ray"
BACKENDS = ("shm", "mooncake", "ray", "memory")
DEFAULT_FIT_SIZES = "4,16,64"
# A round holds the batch about six times over: the parent's batch, the writers' groups, the readers' shards,
# the store's copy, the memcpy and fresh-page references (Mooncake's segment is sized at four batches)
BATCH_COPIES = 6
PROCESS_BYTES = 128 << 20  # one writer or reader: Python, numpy, pyarrow and a store client (RSS ~120 MB at start)


def default_group_size() -> int:
    from dataplane_rl.config.models import GRPOConfig

    return GRPOConfig.model_fields["num_generations_per_prompt"].default


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--backends", default=DEFAULT_BACKENDS, help=f"comma list of shm, mooncake, ray (default {DEFAULT_BACKENDS})")
    p.add_argument("--samples", type=int, default=512, help="rows in the batch (default %(default)s)")
    p.add_argument("--min-len", type=int, default=256, help="shortest row in tokens; lengths are drawn uniformly "
                   "from [min-len, max-len] with a fixed seed (default %(default)s)")
    p.add_argument("--max-len", type=int, default=1024, help="longest row in tokens (default %(default)s)")
    p.add_argument("--writers", type=int, default=1, help="writer processes, putting disjoint groups into one "
                   "partition, interleaved as a run's rollout actors (default %(default)s)")
    p.add_argument("--readers", type=int, default=2, help="reader processes, each getting a contiguous shard of "
                   "the rows (default %(default)s)")
    p.add_argument("--group-size", type=int, default=default_group_size(), help="rows per put, a GRPO group "
                   "(grpo.num_generations_per_prompt); 0: each writer puts all its rows at once (default %(default)s)")
    p.add_argument("--repeats", type=int, default=10, help="steady rounds of create, put, get and drop, timed "
                   "after a cold round and a warm-up round; their median is reported (default %(default)s)")
    p.add_argument("--fit-sizes", default=DEFAULT_FIT_SIZES, help="rows per call of the passes that fit "
                   "time = calls x per_call + bytes / bandwidth for put and get; at least two sizes, or 'none' "
                   f"(default {DEFAULT_FIT_SIZES})")
    p.add_argument("--fit-repeats", type=int, default=3, help="timed rounds per fit size, after one warm-up "
                   "(default %(default)s)")
    p.add_argument("--small-repeats", type=int, default=20, help="timed calls of each small-call kind; 0 skips "
                   "them (default %(default)s)")
    p.add_argument("--profile", help="a folder: every worker runs its calls under cProfile (timing its thread's "
                   "CPU time, so time other processes took from it is not counted) and saves its stats there; the "
                   "top entries of writer 0 and reader 0 are printed (the run's times then include the profiler's)")
    p.add_argument("--topk", type=int, default=0, help="add a teacher's top-k columns to the workload: "
                   "teacher_topk_logprobs (float32) and teacher_topk_ids (int32), [L, K] per row, 8*K bytes per token "
                   "(on-policy distillation; 0: none) (default %(default)s)")
    p.add_argument("--json", help="write results as JSON here")
    p.add_argument("--plot", help="write a bar chart PNG here")


def _fit_sizes(text: str) -> tuple[int, ...]:
    if text.strip().lower() in ("", "none"):
        return ()
    try:
        sizes = tuple(sorted({int(x) for x in text.split(",") if x.strip()}))
    except ValueError:
        raise ConfigError(f"--fit-sizes {text!r}: give a comma list of rows per call, such as {DEFAULT_FIT_SIZES}, "
                          "or none") from None
    if len(sizes) < 2 or sizes[0] < 1:
        raise ConfigError(f"--fit-sizes {text!r}: the fit needs at least two different sizes of at least 1 row")
    return sizes


def checked(args) -> tuple[list[str], Workload]:
    """The backends and the workload `args` ask for; a ConfigError naming the first flag out of its range."""
    backends = [b for b in args.backends.split(",") if b]
    for b in backends:
        if b not in BACKENDS:
            raise ConfigError(f"unknown backend '{b}'; use shm, mooncake, ray")
    for flag in ("samples", "min_len", "max_len", "readers", "repeats", "writers", "fit_repeats"):
        if getattr(args, flag, 1) < 1:
            raise ConfigError(f"--{flag.replace('_', '-')} {getattr(args, flag)}: must be at least 1")
    for flag in ("small_repeats", "group_size", "topk"):
        if getattr(args, flag, 0) < 0:
            raise ConfigError(f"--{flag.replace('_', '-')} {getattr(args, flag)}: must be at least 0")
    if getattr(args, "topk", 0) > MAX_INNER_VALUES:
        raise ConfigError(f"--topk {args.topk}: a token of a shaped column holds at most {MAX_INNER_VALUES} values; "
                          f"use 0-{MAX_INNER_VALUES}")
    if args.min_len > args.max_len:
        raise ConfigError(f"--min-len {args.min_len} is above --max-len {args.max_len}; swap them")
    sizes = _fit_sizes(getattr(args, "fit_sizes", "none") or "none")
    writers, readers = getattr(args, "writers", 1), args.readers
    if writers > args.samples or readers > args.samples:
        raise ConfigError(f"--writers {writers} / --readers {readers}: at most --samples {args.samples} each")
    work = Workload(args.samples, args.min_len, args.max_len, writers, readers,
                    getattr(args, "group_size", default_group_size()), args.repeats, sizes,
                    getattr(args, "fit_repeats", 3), args.small_repeats, getattr(args, "profile", None) or "",
                    getattr(args, "topk", 0))
    fits_memory(work)
    if "mooncake" in backends:
        whole_groups(work)
    return backends, work


def fits_memory(work: Workload) -> None:
    """The processes and a round's copies of the batch must fit in the memory this machine has available."""
    import psutil

    free = psutil.virtual_memory().available
    procs = work.writers + work.readers
    if procs * PROCESS_BYTES > free:
        raise ConfigError(f"--writers {work.writers} and --readers {work.readers}: {procs} processes of about "
                          f"{PROCESS_BYTES >> 20} MiB each, and {free >> 20} MiB are available; at most "
                          f"{free // PROCESS_BYTES} processes together here")
    nbytes = batch_bytes(work.samples, work.min_len, work.max_len, work.topk)
    room = free - procs * PROCESS_BYTES
    if nbytes * BATCH_COPIES > room:
        most = int(room // BATCH_COPIES / max(batch_bytes(1, work.min_len, work.max_len, work.topk), 1))
        topk = f" with --topk {work.topk}" if work.topk else ""
        raise ConfigError(f"--samples {work.samples}: rows of {work.min_len}-{work.max_len} tokens{topk} make a batch "
                          f"of about {nbytes / 2**20:.0f} MiB, a round holds about {BATCH_COPIES} copies, and "
                          f"{room >> 20} MiB are available; use 1-{most} samples at these lengths, or shorter rows"
                          if most else f"--max-len {work.max_len}{topk}: one row of up to {work.max_len} tokens "
                          f"leaves no room in the {room >> 20} MiB available; use a smaller --max-len"
                          + (" or --topk" if work.topk else ""))


def whole_groups(work: Workload) -> None:
    """The raw Mooncake reference gives each reader whole groups of keys: there must be a group per reader."""
    groups = len(group_ranges(work.samples, work.group_size, work.writers))
    if groups >= work.readers:
        return
    most = (work.samples - 1) // (work.readers - 1)
    raise ConfigError(f"--group-size {work.group_size}: {work.samples} samples make {groups} group(s) for "
                      f"{work.readers} readers, and the raw Mooncake reference gives each reader whole groups; use "
                      f"a --group-size of 1-{most}" + (" (0: one group per writer, so --writers at least "
                                                        "--readers)" if work.group_size == 0 else "")
                      + ", or leave mooncake out of --backends")
