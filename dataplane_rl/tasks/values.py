"""A row's values and a reward's extras as the stored columns keep them: strict JSON, numpy/torch scalars as numbers.

The `extra_info`, `ground_truth` and `reward_extra_info` columns (and train_data/) hold JSON text that every reader
must accept, `json.loads` in strict mode and `jq` included, so NaN and the infinities, which JSON has no literal
for, are written as the strings "NaN", "Infinity" and "-Infinity" (protobuf's JSON mapping of a double does the
same). A numpy or torch scalar is written as the Python number (or bool) it holds, never as its repr in a string,
so a reward's `np.float32` extra is logged like a float.
"""

from __future__ import annotations

import json
import math

NON_FINITE = {math.inf: "Infinity", -math.inf: "-Infinity"}


def plain(value):
    """`value` with every numpy/torch scalar or array turned into Python numbers and lists, every non-finite float
    into its string ("NaN", "Infinity", "-Infinity") and every dict key into text."""
    if isinstance(value, float):
        return value if math.isfinite(value) else NON_FINITE.get(value, "NaN")
    if isinstance(value, dict):
        return {str(k): plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [plain(v) for v in value]
    if hasattr(value, "dtype") and callable(getattr(value, "tolist", None)):  # numpy and torch, 0-d or not
        return plain(value.tolist())
    return value


def to_json(value) -> str:
    """`value` as strict JSON text, keys sorted (default=str: dates and such become text)."""
    return json.dumps(plain(value), sort_keys=True, allow_nan=False, default=str)
