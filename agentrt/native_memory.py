"""Native memory of the server process: oneDNN's per-shape caches, glibc malloc's statistics and ``malloc_trim``.

On the CPU, torch runs 16-bit matmuls through oneDNN, which compiles a kernel for each input shape and keeps it
in two LRU caches of 1024 entries each (oneDNN's primitive cache, ``ONEDNN_PRIMITIVE_CACHE_CAPACITY``, and
ideep's, ``LRU_CACHE_CAPACITY``), about 0.27 MB per entry whatever the shape. The engine's steps have as many
row counts as there are batch sizes and prefill chunk lengths, so both caches fill: up to ~0.55 GB of native
memory that looks like a leak while it grows. ``bound_native_caches`` caps them.

Python frees its objects, but the bytes go back to glibc malloc, which keeps freed chunks in per-thread arenas
and returns memory to the OS only from the top of each heap (or by ``malloc_trim``, which also releases whole
free pages inside them). torch's CPU tensors are malloc'd too, so a server whose threads (engine worker,
event loop, the database driver's threads, torch's intra-op pool) allocate and free many tensors of varying
sizes holds more resident memory after each burst of load than its live objects need, until malloc reuses it.
Everything here is a no-op (returns False / {} / []) where malloc is not glibc's.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import os
import re
import time

log = logging.getLogger(__name__)

# oneDNN primitive cache and ideep's cache: entries each (<= ~0.14 GB together at ~0.27 MB an entry). Enough
# for every decode batch size a step sees in a while (each hot row count needs one entry per distinct
# projection shape, 5-7 for the supported architectures); prefill chunks, one new row count each, churn past.
NATIVE_CACHE_CAPACITY = 256
CACHE_CAPACITY_VARIABLES = ("ONEDNN_PRIMITIVE_CACHE_CAPACITY", "LRU_CACHE_CAPACITY")


class _MallInfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in
                ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks", "fordblks",
                 "keepcost")]


def bound_native_caches(capacity: int = NATIVE_CACHE_CAPACITY) -> dict[str, str]:
    """Cap oneDNN's per-shape kernel caches at ``capacity`` entries each, unless the environment already sets
    them. oneDNN and ideep read these variables when they first build a kernel, so call this before the first
    16-bit matmul on the CPU (before the model loads). Returns the values in force."""
    for name in CACHE_CAPACITY_VARIABLES:
        os.environ.setdefault(name, str(capacity))
    return {name: os.environ[name] for name in CACHE_CAPACITY_VARIABLES}


def _load_libc():
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
    except OSError:
        return None
    if not hasattr(libc, "malloc_trim") or not hasattr(libc, "mallinfo2"):
        return None  # not glibc (musl, macOS), or a glibc before 2.33
    if ctypes.cast(ctypes.CDLL(None).malloc, ctypes.c_void_p).value != ctypes.cast(libc.malloc, ctypes.c_void_p).value:
        return None  # another allocator (jemalloc, tcmalloc through LD_PRELOAD) serves malloc: glibc's views are empty
    libc.malloc_trim.argtypes, libc.malloc_trim.restype = [ctypes.c_size_t], ctypes.c_int
    libc.mallinfo2.argtypes, libc.mallinfo2.restype = [], _MallInfo2
    libc.open_memstream.argtypes = [ctypes.POINTER(ctypes.c_char_p), ctypes.POINTER(ctypes.c_size_t)]
    libc.open_memstream.restype = ctypes.c_void_p
    libc.malloc_info.argtypes, libc.malloc_info.restype = [ctypes.c_int, ctypes.c_void_p], ctypes.c_int
    libc.fclose.argtypes, libc.fclose.restype = [ctypes.c_void_p], ctypes.c_int
    libc.free.argtypes, libc.free.restype = [ctypes.c_void_p], None
    return libc


_libc = _load_libc()


def available() -> bool:
    """Whether malloc is glibc's (the only allocator these helpers know)."""
    return _libc is not None


def malloc_trim() -> bool:
    """``malloc_trim(0)``: give free memory in every arena back to the OS. True when some was released."""
    return bool(_libc.malloc_trim(0)) if _libc is not None else False


def malloc_stats() -> dict[str, int]:
    """``mallinfo2`` over all arenas, in bytes: ``in_use`` (allocated chunks), ``free`` (free chunks kept in
    the arenas), ``heap`` (arena memory obtained from the OS), ``mmap`` (chunks mapped on their own)."""
    if _libc is None:
        return {}
    m = _libc.mallinfo2()
    return {"in_use": m.uordblks, "free": m.fordblks, "heap": m.arena, "mmap": m.hblkhd, "mmap_chunks": m.hblks,
            "top_releasable": m.keepcost}


_HEAP = re.compile(r'<heap nr="(\d+)">(.*?)</heap>', re.S)
_TOTAL = re.compile(r'<total type="(\w+)" count="\d+" size="(\d+)"/>')
_SYSTEM = re.compile(r'<system type="current" size="(\d+)"/>')


def malloc_arenas() -> list[dict[str, int]]:
    """One entry per malloc arena (``malloc_info``): bytes obtained from the OS and bytes free in it."""
    if _libc is None:
        return []
    buf, size = ctypes.c_char_p(), ctypes.c_size_t()
    stream = _libc.open_memstream(ctypes.byref(buf), ctypes.byref(size))
    if not stream:
        return []
    try:
        _libc.malloc_info(0, stream)
    finally:
        _libc.fclose(stream)
    try:
        xml = ctypes.string_at(buf, size.value).decode()
    finally:
        _libc.free(buf)
    arenas = []
    for nr, body in _HEAP.findall(xml):
        system = _SYSTEM.search(body)
        free = sum(int(s) for kind, s in _TOTAL.findall(body) if kind in ("fast", "rest"))
        arenas.append({"arena": int(nr), "system": int(system.group(1)) if system else 0, "free": free})
    return arenas


class IdleTrimmer:
    """Calls ``malloc_trim(0)`` when the engine has gone idle after work: at most once per idle period, and
    only after ``idle_s`` seconds without a step, so a busy server never pays for it (a trim walks every
    arena: a few milliseconds). ``note_step`` from the engine loop, ``maybe_trim`` when it finds nothing to do;
    both from one thread."""

    def __init__(self, idle_s: float = 5.0, enabled: bool | None = None):
        self.idle_s = idle_s
        self.enabled = available() if enabled is None else enabled
        self._dirty = False
        self._last_step = time.monotonic()
        self.trims = 0

    def note_step(self) -> None:
        self._dirty = True
        self._last_step = time.monotonic()

    def maybe_trim(self) -> bool:
        if not (self.enabled and self._dirty) or time.monotonic() - self._last_step < self.idle_s:
            return False
        self._dirty = False
        self.trims += 1
        t0 = time.perf_counter()
        released = malloc_trim()
        log.debug("malloc_trim after %.1f s idle: %s in %.1f ms", self.idle_s,
                  "released memory" if released else "nothing released", 1e3 * (time.perf_counter() - t0))
        return released


