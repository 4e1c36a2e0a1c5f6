"""This process's resident memory, now and at its peak, per stage.

Linux keeps a process's high-water mark of resident memory (``VmHWM`` in
``/proc/self/status``); writing ``5`` to ``/proc/self/clear_refs`` resets it to the
current size, so ``reset_peak()`` at a stage's start and ``peak_bytes()`` at its end
give the stage's own peak. Where ``/proc`` is missing (macOS) or the reset is not
allowed, the figures fall back to ``getrusage``'s lifetime peak, and
``peak_is_per_stage()`` says so.
"""

from __future__ import annotations

import ctypes
import os
import resource
import sys

_STATUS = "/proc/self/status"
_CLEAR_REFS = "/proc/self/clear_refs"
_per_stage = False  # whether the last reset_peak() reset the kernel's mark


def _status_kib(field: str) -> int | None:
    try:
        with open(_STATUS) as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1])
    except OSError:
        return None
    return None


def rss_bytes() -> int:
    """Resident memory now (0 where the system does not say)."""
    kib = _status_kib("VmRSS")
    return 0 if kib is None else kib * 1024


def _rusage_peak() -> int:
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak if sys.platform == "darwin" else peak * 1024  # bytes on macOS, KiB on Linux


def peak_bytes() -> int:
    """Peak resident memory since the last ``reset_peak()`` (or the process start)."""
    kib = _status_kib("VmHWM")
    return _rusage_peak() if kib is None else kib * 1024


def reset_peak() -> bool:
    """Starts a new peak at the current size; returns whether the kernel allowed it."""
    global _per_stage
    try:
        with open(_CLEAR_REFS, "w") as f:
            f.write("5")
        _per_stage = True
    except OSError:
        _per_stage = False
    return _per_stage


def peak_is_per_stage() -> bool:
    return _per_stage


def release_free_memory() -> str | None:
    """Returns the allocator's free pages to the system; returns how (None: no way).

    tcmalloc keeps freed spans for reuse (``host_malloc``) and glibc's heap keeps its
    free chunks: between stages, what one stage freed would otherwise stay resident
    while the next builds its own working set. Under tcmalloc this is
    ``MallocExtension_ReleaseFreeMemory``, under glibc ``malloc_trim(0)``.
    """
    try:
        libc = ctypes.CDLL(None)
    except OSError:
        return None
    release = getattr(libc, "MallocExtension_ReleaseFreeMemory", None)
    if release is not None:
        release.restype = None
        release()
        return "tcmalloc"
    trim = getattr(libc, "malloc_trim", None)
    if trim is not None:
        trim.argtypes = (ctypes.c_size_t,)
        trim(0)
        return "glibc"
    return None


def gib(n: int) -> str:
    return f"{n / 2**30:.2f} GiB"


if __name__ == "__main__":  # a quick look: python -m cursor_rl.hostmem
    print(f"pid {os.getpid()}: rss {gib(rss_bytes())}, peak {gib(peak_bytes())}")
