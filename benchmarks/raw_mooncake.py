"""Raw Mooncake throughput, the reference the column-store benchmark is compared against.

    python benchmarks/raw_mooncake.py --samples 512 --layout per-sample --layout per-column --readers 1 2

The code lives in dataplane_rl/bench/raw_mooncake.py and raw_mooncake_main.py; its public names are re-exported here for
scripts and tests that load this file.
"""

import sys

from dataplane_rl.bench.raw_mooncake import DEFAULT_COLUMN_BYTES, raw_mooncake_roundtrip  # noqa: F401
from dataplane_rl.bench.raw_mooncake_main import main, synthetic_buffers  # noqa: F401

if __name__ == "__main__":
    sys.exit(main())
