"""A dead train rank (docs/architecture.md §7): one line naming the rank, its node and what resumes the run; its last output kept.

With checkpointing on, the run rebuilds its train group and resumes from its last checkpoint in-process
(faults/restart.py). Without, or with fault_tolerance.max_restarts spent, a rank that dies stops the run with
TrainRankError, whose line names the rank, its PID and node, and either the checkpoint that `dataplane-rl train
--resume RUN_DIR` continues from or the key that would have saved the steps done. Either way the rank's last
lines of output (Ray's worker log files on this node) are copied to RUN_DIR/faults/.
"""

from __future__ import annotations

import glob
import os
from pathlib import Path

from dataplane_rl.config import CheckpointingConfig
from dataplane_rl.faults.kinds import first_line
from dataplane_rl.faults.ports import TrainGroup
from dataplane_rl.errors import DataPlaneError

TAIL_LINES = 60


class TrainRankError(DataPlaneError, RuntimeError):
    """A train rank died; the run stops with the steps it completed (and its checkpoints)."""


def dead_rank(group: TrainGroup, e: BaseException) -> int | None:
    """The rank whose actor the RayActorError `e` is about, or None (not a train rank's)."""
    aid = getattr(e, "actor_id", None)
    for rank, w in enumerate(group.ranks()):
        if aid and w._actor_id.hex() == aid:
            return rank
    return None


def last_output(pid: int | None, lines: int = TAIL_LINES) -> str:
    """The last lines of the worker process `pid`'s stdout and stderr files in this node's Ray session logs."""
    import ray

    node = getattr(getattr(ray, "_private").worker, "_global_node", None)
    if pid is None or node is None:
        return ""
    out = []
    for path in sorted(glob.glob(os.path.join(node.get_logs_dir_path(), f"worker-*-{pid}.*"))):
        if path.endswith((".out", ".err")):
            with open(path, errors="replace") as f:
                tail = f.readlines()[-lines:]
            out.append(f"==> {path} (last {len(tail)} lines) <==\n{''.join(tail)}")
    return "\n".join(out)


def save_output(group: TrainGroup, rank: int, run_dir: Path) -> Path:
    """Copy train rank `rank`'s last output to RUN_DIR/faults/train-rank-N.log (a second death: .2.log, ...)."""
    pid, _ = group.rank_where(rank)
    folder = Path(run_dir) / "faults"
    folder.mkdir(exist_ok=True)
    head = f"train rank {rank}, pid {pid}\n"
    path, n = folder / f"train-rank-{rank}.log", 1
    while path.exists() and not path.read_text(errors="replace").startswith(head):  # another death's file
        n += 1
        path = folder / f"train-rank-{rank}.{n}.log"
    path.write_text(head + (last_output(pid) or "no output of it found in this node's Ray logs\n"))
    return path


def train_rank_error(group: TrainGroup, ckpt: CheckpointingConfig, e: BaseException, step: int, run_dir: Path,
                     last_checkpoint: int | None, rank: int | None = None):
    """TrainRankError for a RayActorError from a train worker (its output saved), or None for another actor's;
    `ckpt`: the run's checkpointing config. rank: the dead rank when the error came from another (a survivor's,
    faults/restart.py found the dead one)."""
    rank = dead_rank(group, e) if rank is None else rank
    if rank is None:
        return None
    first = first_line(e)
    pid, node = group.rank_where(rank)
    path = save_output(group, rank, run_dir)
    if not ckpt.enabled:
        then = ("checkpointing.enabled=true would have saved the steps done (every checkpointing.save_period steps), "
                "for `dataplane-rl train --resume RUN_DIR` to continue from")
    elif last_checkpoint:
        then = f"`dataplane-rl train --resume {run_dir}` continues from its checkpoint of step {last_checkpoint}"
    else:
        then = f"no checkpoint was saved yet (checkpointing.save_period={ckpt.save_period})"
    return TrainRankError(f"step {step}: train rank {rank} (pid {pid} on {node}) died ({first}); the run stops here; "
                          f"its last output is in {path}; {then}")
