"""Step time and data-plane share of a GRPO step, data plane off vs shm vs Mooncake.

    python benchmarks/e2e_step.py --steps 6 --json e2e.json
"""

import sys

from dataplane_rl.bench.e2e import main

if __name__ == "__main__":
    sys.exit(main())
