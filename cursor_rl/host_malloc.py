"""glibc malloc settings that stop XLA:CPU from page-faulting its scratch memory every step.

XLA:CPU allocates an executable's temporaries as one block per call (~0.5 GB for the
tiny config's forward+backward step), from one of its worker threads. glibc serves a
block that large with a fresh ``mmap`` in the thread's arena and unmaps it on free, so
each step first-touches the whole block again. On the 2-core dev machine that was 132K
minor faults and ~0.2 CPU-seconds of kernel time per tiny step, a quarter of the step's
CPU time; PyTorch, allocating on its main thread from the heap, saw ~4K.

``configure`` sends every thread to the main arena (``M_ARENA_MAX=1``), serves large
blocks from the heap instead of ``mmap`` (``M_MMAP_MAX=0``) and never gives freed heap
memory back (``M_TRIM_THRESHOLD=-1``), so the block is reused without new faults.

It must run before other threads allocate (numpy's OpenBLAS pool starts at import,
XLA's workers at the first computation): a thread that allocated before it keeps an
arena of its own, where blocks that large are mmapped again. So it is an entry
point's first act, never an import's side effect: ``cursor_rl/main.py`` calls it
before importing the rest of ``python -m cursor_rl.main``; ``benchmarks/`` and
``tests/conftest.py`` call it before importing numpy and jax. Later, it does no harm
but may not help. Importing ``cursor_rl`` leaves malloc alone (a sandbox or pool
worker importing the package keeps glibc's defaults).

``CURSOR_RL_HOST_MALLOC`` chooses: ``auto`` (default: when JAX will compute on the CPU,
i.e. ``JAX_PLATFORMS`` names ``cpu`` first, or is unset and no TPU or GPU plugin is
installed; accelerator hosts keep glibc's defaults), ``on`` or ``off``. The settings
hold for this process only; subprocesses (sandboxes, data workers) keep the defaults.

The cost is resident memory: freed blocks stay in the heap for reuse (the tiny
forward+backward process plateaus at ~2.2 GB instead of ~1.2-1.3 GB).
"""

from __future__ import annotations

import ctypes
import importlib.util
import os
import pkgutil
import platform
from collections.abc import Mapping

ENV = "CURSOR_RL_HOST_MALLOC"

# mallopt parameters from glibc's <malloc.h>.
_M_TRIM_THRESHOLD = -1
_M_MMAP_MAX = -4
_M_ARENA_MAX = -8
# -1 turns trimming off (mallopt(3)); a finite threshold must fit an int, and 2 GiB
# still trimmed when two executables' temporaries (1.2 and 1.3 GB for the wide
# benchmark config) were freed together, so every step faulted them in again.
NO_TRIM = -1

applied = False  # whether configure() changed the settings in this process


def accelerator_plugin_installed() -> bool:
    """Whether JAX could find a TPU or GPU here (libtpu, or a ``jax_plugins`` module)."""
    if importlib.util.find_spec("libtpu") is not None:
        return True
    plugins = importlib.util.find_spec("jax_plugins")
    return plugins is not None and any(pkgutil.iter_modules(plugins.submodule_search_locations))


def wanted(
    environ: Mapping[str, str] = os.environ, accelerator=accelerator_plugin_installed
) -> bool:
    """Whether the settings should apply, from CURSOR_RL_HOST_MALLOC and JAX_PLATFORMS."""
    mode = environ.get(ENV, "auto").strip().lower()
    if mode == "on":
        return True
    if mode == "off":
        return False
    if mode != "auto":
        raise ValueError(f"{ENV}={environ[ENV]!r}: expected one of auto, on, off")
    platforms = environ.get("JAX_PLATFORMS", "").strip()
    if platforms:
        return platforms.split(",")[0].strip().lower() == "cpu"
    return not accelerator()


def configure(environ: Mapping[str, str] = os.environ) -> bool:
    """Applies the settings when wanted and the C library is glibc; returns whether it did."""
    global applied
    if applied or not wanted(environ) or platform.libc_ver()[0] != "glibc":
        return applied
    mallopt = ctypes.CDLL(None).mallopt
    mallopt.argtypes = (ctypes.c_int, ctypes.c_int)
    ok = [
        mallopt(_M_ARENA_MAX, 1),
        mallopt(_M_MMAP_MAX, 0),
        mallopt(_M_TRIM_THRESHOLD, NO_TRIM),
    ]
    applied = all(ok)
    return applied
