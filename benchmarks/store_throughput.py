"""Column-store throughput vs the memcpy ceiling, the shm floor and raw Mooncake (also `dataplane-rl bench store`).

    python benchmarks/store_throughput.py --backends shm,mooncake,ray --json store.json --plot store.png
    # the large step: 4 writers putting GRPO groups, 4 readers, the fit and the targets
    python benchmarks/store_throughput.py --backends shm,mooncake --samples 4096 --min-len 512 --max-len 4096 \\
        --writers 4 --readers 4 --repeats 5 --fit-repeats 2 --small-repeats 10 --json store-large.json
"""

import sys

from dataplane_rl.bench.store import main

if __name__ == "__main__":
    sys.exit(main())
