"""What checkpoint verification and async GRPO's saved partitions cost, in bytes and seconds.

    python benchmarks/checkpoint_cost.py [--repeats 5] [--json out.json]

1. A 2-step async run of the default config (age 1, a checkpoint every step): its checkpoint's bytes,
   the bytes of the partition saved with it, and the median seconds to verify the whole checkpoint.
2. That partition tiled to 4096 samples: bytes and median seconds to write it as Arrow IPC and hash it
   (what save_ahead adds on top of waiting for the generation in flight).
3. The ~24.5M-parameter bench model (`bench generate --model small-24m`) with its AdamW state, saved by a
   real FSDP2 train worker (world 1): checkpoint bytes and median verification seconds. The ceiling is
   reading the same bytes without hashing, measured in the same run.
"""

from __future__ import annotations

import argparse
import json
import socket
import statistics
import sys
import tempfile
import time
from pathlib import Path


def median_s(fn, repeats: int) -> float:
    fn()  # warm: the page cache holds the files, as it does right after a save
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def read_only(folder: Path) -> None:
    for p in folder.rglob("*"):
        if p.is_file():
            with open(p, "rb") as f:
                while f.read(1 << 20):
                    pass


def folder_bytes(folder: Path) -> int:
    return sum(p.stat().st_size for p in folder.rglob("*") if p.is_file())


def verify_cost(ckpt: Path, repeats: int) -> dict:
    from dataplane_rl.checkpoint.files import damage

    assert damage(ckpt) is None, damage(ckpt)
    return {"bytes": folder_bytes(ckpt), "verify_s": median_s(lambda: damage(ckpt), repeats),
            "read_only_s": median_s(lambda: read_only(ckpt), repeats)}


def default_run(tmp: Path, repeats: int) -> tuple[dict, object]:
    import pyarrow as pa

    from dataplane_rl.config import load_config
    from dataplane_rl.driver.loop import train

    run_dir = tmp / "default"
    train(load_config(None, ["grpo.max_num_steps=2", "grpo.async_grpo.enabled=true", "grpo.val_period=0",
                             "loss_fn.use_importance_sampling_correction=true", "checkpointing.enabled=true",
                             "checkpointing.save_period=1", "logger.progress=false", f"logger.run_dir={run_dir}"]))
    ckpt = run_dir / "checkpoints" / "step_000001"  # holds step 2, generated ahead
    part = next((ckpt / "partitions").iterdir())
    with pa.memory_map(str(part)) as f:
        table = pa.ipc.open_file(f).read_all()
    out = verify_cost(ckpt, repeats)
    out.update(partition_rows=table.num_rows, partition_bytes=part.stat().st_size)
    return out, table


def partition_cost(table, rows: int, tmp: Path, repeats: int) -> dict:
    import pyarrow as pa

    from dataplane_rl.checkpoint.files import file_digest

    big = pa.concat_tables([table] * (rows // table.num_rows + 1)).slice(0, rows).combine_chunks()
    path = tmp / "tiled.arrow"

    def save() -> None:
        with pa.OSFile(str(path), "wb") as f, pa.ipc.new_file(f, big.schema) as w:
            w.write_table(big)
        file_digest(path)

    s = median_s(save, repeats)
    return {"rows": rows, "bytes": path.stat().st_size, "write_and_hash_s": s}


def bench_model_checkpoint(tmp: Path, repeats: int) -> dict:
    import torch

    from dataplane_rl.bench.generate import build_small
    from dataplane_rl.config import load_config
    from dataplane_rl.train.state import save_worker
    from dataplane_rl.checkpoint.files import write_manifest
    from dataplane_rl.train.worker import TrainWorker

    cfg = load_config(None, [])
    w = TrainWorker(cfg.model_dump(mode="json", by_alias=True), str(build_small(cfg.grpo.seed)), None, 0, 1, 2)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    w.init_dist(f"tcp://127.0.0.1:{port}")
    try:
        for p in w.model.parameters():  # one optimizer step, so AdamW's moments exist as in a real checkpoint
            p.grad = torch.zeros_like(p)
        w.opt.step()
        ckpt = tmp / "small24m"
        ckpt.mkdir()
        save_worker(w, str(ckpt / "train"))
        write_manifest(ckpt, 1)
        params = sum(p.numel() for p in w.model.parameters())
    finally:
        w.close()
    return {"params": params, **verify_cost(ckpt, repeats)}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--json")
    args = ap.parse_args(argv)
    with tempfile.TemporaryDirectory() as d:
        tmp = Path(d)
        default, table = default_run(tmp, args.repeats)
        result = {"default_checkpoint": default,
                  "partition_4096": partition_cost(table, 4096, tmp, args.repeats),
                  "small_24m_checkpoint": bench_model_checkpoint(tmp, args.repeats)}
    text = json.dumps(result, indent=1)
    print(text)
    if args.json:
        Path(args.json).write_text(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
