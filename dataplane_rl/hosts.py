"""Which address a process tells its peers, and Mooncake's logging (standard library only: holders import it).

Every Mooncake client and holder tells its peers an address to reach it at (`local_hostname` of setup()).
On one machine that is 127.0.0.1; across machines it must be the node's own IP, or peers on other hosts
would dial their own loopback. `advertise_host` picks it, `interface_of` finds the network interface
holding an IP (for gloo), `quiet_glog` silences Mooncake's glog lines.
"""

from __future__ import annotations

import ctypes
import fcntl
import os
import socket
import struct
import sys

from dataplane_rl.errors import StoreUnavailableError

HOST_ENV = "DATAPLANE_RL_MOONCAKE_HOST"  # per-node override of the address a client or holder advertises


def is_loopback(host: str) -> bool:
    return host == "localhost" or host.startswith("127.") or host == "::1"


def advertise_host(master_address: str, explicit: str | None = None) -> str:
    """The address this process's Mooncake client (or holder) tells its peers to reach it at.

    explicit > 127.0.0.1 for a master on loopback (a one-machine store) > $DATAPLANE_RL_MOONCAKE_HOST >
    this node's Ray IP (inside a Ray worker or driver) > the local address of the route to the master.
    Peers on other hosts connect to this address: 127.0.0.1 there would be their own loopback."""
    if explicit:
        return explicit
    host, _, port = master_address.rpartition(":")
    if is_loopback(host):
        return "127.0.0.1"
    if os.environ.get(HOST_ENV):
        return os.environ[HOST_ENV]
    if "ray" in sys.modules:
        import ray  # noqa: PLC0415 - only when this process already uses Ray

        if ray.is_initialized():
            return ray.util.get_node_ip_address()
    # connect() on a UDP socket sends nothing; it makes the kernel pick the source address for that route
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            s.connect((host, int(port)))
            return s.getsockname()[0]
        except OSError as e:
            raise StoreUnavailableError(f"no route from this host to the Mooncake master {master_address}: {e}; "
                                        f"set {HOST_ENV} to this host's address") from e


_quiet_done = False


def quiet_glog() -> None:
    """Silence Mooncake's glog output in this process (its clients log INFO lines, and an
    `E... Local segment descriptor not found` on every setup, which reads like a failure but is not).

    Mooncake overwrites glog's FLAGS_minloglevel from MC_LOG_LEVEL (INFO/WARNING/ERROR, default INFO) once,
    when the transfer engine first reads its global config (mooncake-transfer-engine/src/config.cpp), so
    GLOG_minloglevel has no effect. We load that config now and then raise the level to FATAL. A user who
    sets MC_LOG_LEVEL gets Mooncake's own behaviour (e.g. MC_LOG_LEVEL=INFO shows everything).
    Failures here (a Mooncake build without these symbols) only leave the logs on."""
    global _quiet_done
    if _quiet_done or os.environ.get("MC_LOG_LEVEL"):
        return
    _quiet_done = True
    try:
        import mooncake.store as store  # noqa: PLC0415 - optional dependency

        lib = ctypes.CDLL(store.__file__)  # the already loaded extension: dlopen returns the same handle
        load_config = lib._ZN8mooncake12globalConfigEv  # mooncake::globalConfig(): loads it once
        load_config.restype = ctypes.c_void_p
        load_config()
        ctypes.c_int.in_dll(lib, "_ZN3fLI17FLAGS_minloglevelE").value = 3  # google::FATAL
    except (AttributeError, ImportError, OSError, ValueError):
        pass


def interface_of(ip: str) -> str | None:
    """The name of the local network interface that holds IPv4 address `ip`, or None."""
    SIOCGIFADDR = 0x8915  # linux/sockios.h
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        for _, name in socket.if_nameindex():
            try:
                raw = fcntl.ioctl(s.fileno(), SIOCGIFADDR, struct.pack("256s", name.encode()[:15]))
            except OSError:  # interface without an IPv4 address
                continue
            if socket.inet_ntoa(raw[20:24]) == ip:
                return name
    return None
