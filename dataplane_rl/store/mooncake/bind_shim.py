"""Make a Mooncake holder really listen on one address: the `bind_local.c` LD_PRELOAD shim, built on demand.

Mooncake binds its handshake and TCP data listeners to the wildcard address whatever address it
advertises (mooncake-transfer-engine: findAvailableTcpPort and the handshake daemon bind INADDR_ANY,
the TCP transport's acceptor [::]), and has no switch for it; MC_TCP_BIND_ADDRESS only names the
advertised address. So a one-machine store that says 127.0.0.1 would accept connections on every
interface. MooncakeCluster starts its holders with this shim preloaded and DATAPLANE_RL_BIND_ADDRESS set:
their wildcard binds become binds to that address. It is compiled once per source version with the
system C compiler into the user's cache; without a compiler `shim_path()` returns None and the holders
listen as Mooncake does. A library cannot do this for us: the bind calls are inside Mooncake's C++. A
process that is already running (a library user's) gets the same bind() without a preload: bind_patch.py.
"""

from __future__ import annotations

import hashlib
import logging
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

log = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("bind_local.c")
ADDRESS_ENV = "DATAPLANE_RL_BIND_ADDRESS"
_built: dict[str, str | None] = {}


def shim_path() -> str | None:
    """The compiled shim (built on first use), or None when no C compiler can build it."""
    source = SOURCE.read_bytes()
    digest = hashlib.sha256(source).hexdigest()[:12]
    if digest in _built:
        return _built[digest]
    cache = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "dataplane-rl"
    target = cache / f"bind_local-{digest}.so"
    if not target.is_file():
        cc = shutil.which(os.environ.get("CC", "cc")) or shutil.which("gcc")
        if cc is None:
            # said once where it matters: the `train` security line, or a local store's ListenWarning
            log.debug("no C compiler: the bind shim cannot be built")
            _built[digest] = None
            return None
        cache.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=cache, suffix=".so.tmp")
        os.close(fd)
        p = subprocess.run([cc, "-shared", "-fPIC", "-O2", "-o", tmp, str(SOURCE), "-ldl"],
                           capture_output=True, text=True, timeout=120)
        if p.returncode:
            os.unlink(tmp)
            log.warning("could not build %s (%s); Mooncake holders will listen on all interfaces", SOURCE, p.stderr[-500:])
            _built[digest] = None
            return None
        os.replace(tmp, target)  # atomic: concurrent builders each produce the same file
    _built[digest] = str(target)
    return _built[digest]


def bind_env(address: str, env: dict[str, str]) -> dict[str, str]:
    """`env` with the shim preloaded so that wildcard binds go to `address` (unchanged without the shim)."""
    path = shim_path()
    if path is None:
        return env
    preload = " ".join(dict.fromkeys(p for p in (path, *env.get("LD_PRELOAD", "").split()) if p))  # once
    return {**env, "LD_PRELOAD": preload, ADDRESS_ENV: address}
