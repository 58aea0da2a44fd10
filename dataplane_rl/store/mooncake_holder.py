"""`python -m dataplane_rl.store.mooncake_holder ...`: the holder's old command line, kept for multi-host
launch scripts (README). The holder is dataplane_rl.store.mooncake.holder."""

import sys

from dataplane_rl.store.mooncake.holder import main

if __name__ == "__main__":
    sys.exit(main())
