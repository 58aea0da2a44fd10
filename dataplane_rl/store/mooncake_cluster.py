"""Where the Mooncake cluster and client helpers used to live: kept as an import path for callers and
scripts that name it (train/placement.py, multi-host setups). The code is in store/mooncake/."""

from dataplane_rl.hosts import HOST_ENV, advertise_host, is_loopback, quiet_glog  # noqa: F401
from dataplane_rl.store.mooncake.client import *  # noqa: F401,F403
from dataplane_rl.store.mooncake.client import ERROR_NAMES  # noqa: F401
from dataplane_rl.store.mooncake.cluster import HolderInfo, MooncakeCluster  # noqa: F401
