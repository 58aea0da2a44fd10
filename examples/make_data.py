"""Write examples/data/train.parquet and val.parquet: small sums and differences in verl's layout (run: python examples/make_data.py).

Each row is what verl's data preprocessing scripts write: data_source, prompt (chat messages), ability,
reward_model {style, ground_truth}, extra_info. Lower-case text and digits only, so the tiny model's character
tokenizer reads every prompt. Seeded: the files are the same on every machine.
"""

from __future__ import annotations

import random
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq


def rows(n: int, split: str, seed: int) -> list[dict]:
    rng = random.Random(seed)
    out, seen = [], set()
    while len(out) < n:
        a, b, op = rng.randint(0, 49), rng.randint(0, 49), rng.choice("+-")
        if (a, b, op) in seen:
            continue
        seen.add((a, b, op))
        answer = a + b if op == "+" else a - b
        out.append({
            "data_source": "add" if op == "+" else "sub",
            "prompt": [{"role": "user", "content": f"what is {a}{op}{b}?"}],
            "ability": "math",
            "reward_model": {"style": "rule", "ground_truth": str(answer)},
            "extra_info": {"split": split, "index": len(out), "a": a, "b": b},
        })
    return out


def main() -> None:
    folder = Path(__file__).resolve().parent / "data"
    folder.mkdir(exist_ok=True)
    everything = rows(360, "train", seed=0)
    for name, part in (("train", everything[:300]), ("val", everything[300:])):
        for i, r in enumerate(part):
            r["extra_info"] = {**r["extra_info"], "split": name, "index": i}
        pq.write_table(pa.Table.from_pylist(part), folder / f"{name}.parquet")
        print(f"{folder / f'{name}.parquet'}: {len(part)} rows")


if __name__ == "__main__":
    main()
