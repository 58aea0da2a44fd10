"""Column-store throughput vs the memcpy ceiling and raw Mooncake (also `dataplane-rl bench store`).

    python benchmarks/store_throughput.py --backends shm,mooncake,ray --json store.json --plot store.png
    python benchmarks/store_throughput.py --samples 4096 --min-len 1024 --max-len 4096   # the large case
"""

import sys

from dataplane_rl.bench.store import main

if __name__ == "__main__":
    sys.exit(main())
