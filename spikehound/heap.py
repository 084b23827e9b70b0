"""Keep the C heap from holding on to memory Python has freed (glibc's malloc; elsewhere a no-op).

A daemon that runs for months must give back what a burst took. Python frees its objects, but glibc's
``malloc`` keeps freed memory in its heaps for reuse: after a restart's catch-up (hundreds of thousands of
replayed spans held in windows) or a checkpoint's pickle (tens of MB), the soak
(``python -m benchmarks.soak``) saw the collector's RSS stay 150-300 MB above what it used, because a few
long-lived objects sat among the freed ones. Three settings cure it:

* at most two malloc arenas (glibc's default is eight per core: every thread that ever allocated, such as
  the gRPC and writer threads, keeps an arena of its own, each with its own free memory);
* a fixed threshold of 1 MiB above which a block is mapped on its own and unmapped when freed (glibc
  otherwise raises it after each large free, so the next checkpoint's blob lands in the heap);
* :func:`release_free_heap` after each checkpoint and after a catch-up, in the collector and in its detection
  process: free pages go back to the system.

What the heaps hold is read by :func:`heap_used_and_free_bytes` and :func:`sqlite_heap_bytes`
(SQLite's own count of its page caches, which live in malloc's heaps too), for the collector's
``spikehound_process_heap_bytes``.

>>> import sys
>>> configure_malloc() == sys.platform.startswith("linux")  # glibc here; elsewhere nothing to set
True
>>> release_free_heap() >= 0  # what was free, now given back
True
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import re
from typing import Any, NamedTuple

__all__ = ["configure_malloc", "heap_free_bytes", "heap_used_and_free_bytes", "python_arenas", "release_free_heap",
           "sqlite_heap_bytes"]

log = logging.getLogger(__name__)

_M_MMAP_THRESHOLD = -3  # mallopt parameters (malloc.h)
_M_ARENA_MAX = -8
ARENAS = 2
MMAP_THRESHOLD = 2**20


class _MallInfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks",
                                                     "fsmblks", "uordblks", "fordblks", "keepcost")]


def _glibc() -> ctypes.CDLL | None:
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        libc.mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
        libc.malloc_trim.argtypes = [ctypes.c_size_t]
        libc.mallinfo2.restype = _MallInfo2
    except (OSError, AttributeError):  # not glibc (musl, macOS), or older than 2.33
        return None
    return libc


_LIBC = _glibc()


def _python_malloc_stats() -> Any:
    """CPython's ``_PyObject_DebugMallocStats(FILE *)`` with the GIL held (``pythonapi``), or None."""
    if _LIBC is None:
        return None
    try:
        stats = ctypes.pythonapi._PyObject_DebugMallocStats
        _LIBC.open_memstream.restype = ctypes.c_void_p
        _LIBC.open_memstream.argtypes = [ctypes.POINTER(ctypes.c_char_p), ctypes.POINTER(ctypes.c_size_t)]
        _LIBC.fclose.argtypes = [ctypes.c_void_p]
        _LIBC.free.argtypes = [ctypes.c_void_p]
    except AttributeError:  # another Python than CPython, or no open_memstream
        return None
    stats.argtypes = [ctypes.c_void_p]
    stats.restype = ctypes.c_int
    return stats


_MALLOC_STATS = _python_malloc_stats()
_STAT_LINE = re.compile(r"^(# bytes in allocated blocks|# arenas allocated current|# arenas highwater mark|Total)"
                        r"\s*=\s*([\d,]+)$", re.M)


def _sqlite() -> ctypes.CDLL | None:
    """The SQLite library Python's ``sqlite3`` module is linked to (one instance per process), or None."""
    try:
        import _sqlite3

        lib = ctypes.CDLL(ctypes.util.find_library("sqlite3") or "libsqlite3.so.0")
        lib.sqlite3_memory_used.restype = ctypes.c_int64
        lib.sqlite3_libversion.restype = ctypes.c_char_p
        # A copy of another version than the module's (a statically linked build) counts nothing of it.
        if lib.sqlite3_libversion().decode() != _sqlite3.sqlite_version:
            return None
    except (OSError, AttributeError, ImportError):
        return None
    return lib


_SQLITE = _sqlite()


def configure_malloc() -> bool:
    """At start, before threads: two arenas and a fixed mmap threshold. False where malloc is not glibc's."""
    if _LIBC is None:
        return False
    return bool(_LIBC.mallopt(_M_ARENA_MAX, ARENAS)) and bool(_LIBC.mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD))


def heap_free_bytes() -> int:
    """Bytes free in malloc's heaps (0 where unknown); pages :func:`release_free_heap` gave back still count."""
    return int(_LIBC.mallinfo2().fordblks) if _LIBC is not None else 0


def heap_used_and_free_bytes() -> tuple[int, int]:
    """Bytes in use from malloc (its heaps' blocks and those mapped on their own) and bytes free in its heaps,
    from one walk of the arenas ((0, 0) where unknown)."""
    if _LIBC is None:
        return 0, 0
    info = _LIBC.mallinfo2()
    return int(info.uordblks + info.hblkhd), int(info.fordblks)


class PythonArenas(NamedTuple):
    """Python's small-object arenas, in bytes (see :func:`python_arenas`)."""

    mapped: int  # what the RSS holds of them
    in_use: int  # in their allocated blocks: the live small objects
    peak_mapped: int  # the most ever mapped at once


def python_arenas() -> PythonArenas:
    """Python's small-object arenas now; all 0 where unknown.

    Python gives an arena back only when none of its blocks is in use, so mapped far above in use is a burst's
    peak kept by a few live objects scattered through it, not objects kept. Read from CPython's own report
    (``sys._debugmallocstats``, written to a memory stream instead of stderr): a walk of every pool, a few
    milliseconds on a few hundred MB, so for a scrape, not the hot path.

    >>> arenas = python_arenas()
    >>> arenas == (0, 0, 0) or arenas.peak_mapped >= arenas.mapped > arenas.in_use > 0
    True
    """
    unknown = PythonArenas(0, 0, 0)
    if _LIBC is None or _MALLOC_STATS is None:
        return unknown
    text, size = ctypes.c_char_p(), ctypes.c_size_t()
    stream = _LIBC.open_memstream(ctypes.byref(text), ctypes.byref(size))
    if not stream:
        return unknown
    try:
        _MALLOC_STATS(stream)
    finally:
        _LIBC.fclose(stream)  # sets text and size
    try:
        report = ctypes.string_at(text, size.value).decode(errors="replace")
    finally:
        _LIBC.free(text)
    figures: dict[str, int] = {}
    for name, value in _STAT_LINE.findall(report):
        figures.setdefault(name, int(value.replace(",", "")))  # the first "Total" is the arenas' (the map's follows)
    try:
        mapped, arenas = figures["Total"], figures["# arenas allocated current"]
        peak = figures["# arenas highwater mark"] * mapped // arenas if arenas else 0
        return PythonArenas(mapped, figures["# bytes in allocated blocks"], peak)
    except KeyError:
        return unknown


def sqlite_heap_bytes() -> int:
    """Bytes SQLite holds in this process (page caches, statements; ``sqlite3_memory_used``), 0 where unknown."""
    return int(_SQLITE.sqlite3_memory_used()) if _SQLITE is not None else 0


def release_free_heap() -> int:
    """Give the heaps' free pages back to the system; the bytes of free heap that were there (0 where unknown).

    It walks every arena under its lock: tens of milliseconds on a heap of a few hundred MB, so it runs after
    events that free a lot (a checkpoint, a catch-up), not on the hot path.
    """
    if _LIBC is None:
        return 0
    free = heap_free_bytes()
    _LIBC.malloc_trim(0)
    return free
