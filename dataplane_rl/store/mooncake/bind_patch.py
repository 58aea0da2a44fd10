"""Make this process's Mooncake listeners bind one address without a preload: Mooncake's `bind` slots point at the shim.

The bind shim (bind_shim.py) works by LD_PRELOAD, which must be set before a process starts: the CLI
does it for its driver and every Ray process, but a program that imports the store (`open_store(
"mooncake://")` in plain Python) already runs. Mooncake 0.3.13 has no setting for its listen address
(docs/security.md), so this module redirects its calls instead: each of Mooncake's shared libraries
calls libc's bind() through one slot of its global offset table (a JUMP_SLOT or GLOB_DAT relocation
of the symbol `bind`); `bind_here` finds those slots in the libraries loaded in this process and points
them at the shim's bind(), loaded with dlopen, so only Mooncake's binds change and nothing else in the
process. Where that cannot be done (no C compiler to build the shim, an unknown ELF layout), it warns
once per process, naming what listens where and the fix (ListenWarning).
"""

from __future__ import annotations

import ctypes
import functools
import glob
import importlib.util
import mmap
import os
import struct
import threading
import warnings

from dataplane_rl.store.mooncake.bind_shim import ADDRESS_ENV, shim_path

SECURITY_DOC = "docs/security.md"
# relocation types that fill a slot with a symbol's address (elf.h), by e_machine
_SLOT_RELOCS = {62: {6, 7},  # EM_X86_64: R_X86_64_GLOB_DAT, R_X86_64_JUMP_SLOT
                183: {1025, 1026}}  # EM_AARCH64: R_AARCH64_GLOB_DAT, R_AARCH64_JUMP_SLOT
_SHT_RELA, _SHT_DYNSYM = 4, 11


class ListenWarning(RuntimeWarning):
    """Something this process starts accepts connections on more interfaces than it needs to."""


_lock = threading.Lock()
_patched: dict[str, int] = {}  # library path -> slots pointed at the shim
_warned = False
_shim: ctypes.CDLL | None = None  # the shim, once loaded here


def warn_once(what: str, reason: str, fix: str) -> None:
    """One ListenWarning per process, whoever calls first (the cluster's start or a client's open)."""
    global _warned
    with _lock:
        if _warned:
            return
        _warned = True
    warnings.warn(f"{what} accept connections on every interface (random ports), not only 127.0.0.1: {reason}; "
                  f"{fix} ({SECURITY_DOC})", ListenWarning, stacklevel=3)


def warn_no_shim() -> None:
    cache = os.path.join(os.environ.get("XDG_CACHE_HOME") or "~/.cache", "dataplane-rl")
    warn_once("the local Mooncake store's listeners (this process's client and the store's holders)",
              "no C compiler built the bind shim (dataplane_rl/store/mooncake/bind_local.c) that makes them bind 127.0.0.1",
              f"install cc (the next open builds it once into {cache}), or drop inbound TCP on every interface "
              "but lo")


def bind_here(address: str | None) -> bool:
    """From now on, wildcard binds of the Mooncake libraries loaded in this process bind `address` (an
    IPv4 literal); None: they bind as Mooncake does again (a client of a store on another host, whose
    advertised address may be one this host cannot bind, say behind NAT). Call it after
    `import mooncake.store` and before setup(). False, with one ListenWarning, when it cannot."""
    global _shim
    if address is None:
        if _shim is not None:
            _shim.dataplane_rl_bind_to(b"")
        return True
    path = shim_path()
    if path is None:
        warn_no_shim()
        return False
    _shim = _shim or ctypes.CDLL(path)  # RTLD_LOCAL: its bind() serves only the slots pointed at it
    _shim.dataplane_rl_bind_to(address.encode())
    try:
        with _lock:
            count = sum(_patch(lib, base, ctypes.cast(_shim.bind, ctypes.c_void_p).value)
                        for lib, base in _mooncake_libraries())
    except (OSError, ValueError, struct.error) as e:
        reason = f"{type(e).__name__}: {e}"
    else:
        if count:
            return True
        reason = "no bind() slot found in Mooncake's loaded libraries"
    warn_once("this process's Mooncake client listeners", f"its bind() calls could not be redirected ({reason})",
              f"start Python with the shim preloaded, as `dataplane-rl train` does: LD_PRELOAD={path} "
              f"{ADDRESS_ENV}={address} python ...")
    return False


def _patch(lib: str, base: int, target: int) -> int:
    """Point every bind() slot of `lib` (loaded at `base`) at `target`; how many slots point there now."""
    if lib not in _patched:
        slots = _bind_slots(lib)
        for offset in slots:
            _write_pointer(base + offset, target)
        _patched[lib] = len(slots)
    return _patched[lib]


def _mooncake_libraries() -> list[tuple[str, int]]:
    """(path, load address) of each loaded shared object of the Mooncake wheel (its package folder and
    the bundled `.libs` folder next to it), from dl_iterate_phdr: the dynamic loader's own list."""
    spec = importlib.util.find_spec("mooncake")
    roots = [_real(p) for p in (spec.submodule_search_locations or [])] if spec else []
    roots += [_real(p) for r in list(roots) for p in glob.glob(os.path.join(os.path.dirname(r), "mooncake*.libs"))]
    roots = [r + os.sep for r in roots]
    found: list[tuple[str, int]] = []

    class Info(ctypes.Structure):  # struct dl_phdr_info, the two fields we read
        _fields_ = [("addr", ctypes.c_void_p), ("name", ctypes.c_char_p)]

    @ctypes.CFUNCTYPE(ctypes.c_int, ctypes.POINTER(Info), ctypes.c_size_t, ctypes.c_void_p)
    def visit(info, _size, _data):  # runs in this thread, inside dl_iterate_phdr
        name = _real((info.contents.name or b"").decode(errors="replace"))
        if name and name.startswith(tuple(roots)):
            found.append((name, info.contents.addr or 0))
        return 0

    ctypes.CDLL(None).dl_iterate_phdr(visit, None)
    return found


@functools.lru_cache(maxsize=None)
def _real(path: str) -> str:  # a loaded library's path: fixed for the process, and asked on every open
    return os.path.realpath(path) if path else ""


def _bind_slots(path: str) -> list[int]:
    """Offsets (from the load address) of the slots that relocations of symbol `bind` fill, read from the
    ELF file's section headers. Hand-parsed: six struct layouts (elf.h) for one lookup are not worth a
    dependency."""
    with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as m:
        if m[:4] != b"\x7fELF" or m[4] != 2 or m[5] != 1:
            raise ValueError(f"{path} is not a 64-bit little-endian ELF file")
        machine, = struct.unpack_from("<H", m, 18)
        if machine not in _SLOT_RELOCS:
            raise ValueError(f"{path}: machine type {machine} is not x86-64 or aarch64")
        shoff, = struct.unpack_from("<Q", m, 40)
        shentsize, shnum = struct.unpack_from("<HH", m, 58)
        # (type, offset, size, link, entsize) of each section
        sections = [(s[1], s[4], s[5], s[6], s[9]) for s in
                    (struct.unpack_from("<IIQQQQIIQQ", m, shoff + i * shentsize) for i in range(shnum))]
        slots = []
        for kind, offset, size, link, entsize in sections:
            if kind != _SHT_RELA or not entsize or sections[link][0] != _SHT_DYNSYM:
                continue
            _, sym_off, _, str_link, sym_entsize = sections[link]
            str_off = sections[str_link][1]
            for r_offset, r_info, _ in struct.iter_unpack("<QQq", m[offset:offset + size]):
                if r_info & 0xFFFFFFFF not in _SLOT_RELOCS[machine]:
                    continue
                name_off, = struct.unpack_from("<I", m, sym_off + (r_info >> 32) * sym_entsize)
                start = str_off + name_off
                if m[start:m.find(b"\0", start)] == b"bind":
                    slots.append(r_offset)
        return slots


def _write_pointer(address: int, value: int) -> None:
    """Store `value` at `address`, making the page writable for the store if the loader sealed it (RELRO)."""
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mprotect.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    page = mmap.PAGESIZE
    start = address & ~(page - 1)
    prot = _protection(address)
    writable = prot | 0x2  # PROT_WRITE
    if prot != writable and libc.mprotect(start, page, writable):
        raise OSError(ctypes.get_errno(), f"mprotect of the bind() slot at {address:#x}: {os.strerror(ctypes.get_errno())}")
    ctypes.c_void_p.from_address(address).value = value  # one aligned 8-byte store: atomic for a concurrent caller
    if prot != writable:
        libc.mprotect(start, page, prot)


def _protection(address: int) -> int:
    """PROT_* bits of the mapping holding `address`, from /proc/self/maps."""
    with open("/proc/self/maps") as f:
        for line in f:
            span, perms = line.split()[:2]
            lo, hi = (int(x, 16) for x in span.split("-"))
            if lo <= address < hi:
                return (perms[0] == "r") * 1 | (perms[1] == "w") * 2 | (perms[2] == "x") * 4
    raise ValueError(f"address {address:#x} of a bind() slot is not mapped")
