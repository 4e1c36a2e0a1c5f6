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

The cost is resident memory: glibc's heap only grows, and fragments as small
allocations land in the space of freed temporaries, so a process needs more heap for
every new executable (tiny, 30 steps: pretraining peaked at 4.8 GiB, long-context at
8.6 GiB, against 2.1 / 2.7 with glibc's defaults; ``benchmarks/memory_bench.py``).

**A preloaded allocator does better than both.** tcmalloc (gperftools) keeps freed
spans for reuse without glibc's fragmentation: tiny pretraining at the tuned glibc's
speed (4,806 vs 4,858 tokens/s) with a 2.9 GiB peak. ``preload()`` re-executes the
entry point with tcmalloc in ``LD_PRELOAD`` (the library must be installed:
``launch/install_system_deps.sh`` installs ``libtcmalloc-minimal4``), then removes it
from the environment, so subprocesses (sandboxes, data workers) keep glibc's
defaults. ``cursor_rl/main.py`` calls ``preload()`` first and ``configure()`` only when
no allocator was preloaded (``configure`` does nothing under one).

``CURSOR_RL_HOST_MALLOC`` chooses: ``auto`` (default: when JAX will compute on the CPU,
i.e. ``JAX_PLATFORMS`` names ``cpu`` first, or is unset and no TPU or GPU plugin is
installed: tcmalloc where ``preload()`` is called and the library is installed, else
the glibc settings; accelerator hosts keep glibc's defaults), ``tcmalloc`` or
``jemalloc`` (preloaded), ``on`` (the glibc settings) or ``off``.
"""

from __future__ import annotations

import ctypes
import importlib.util
import os
import pkgutil
import platform
import sys
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

# Allocators that replace glibc's malloc when preloaded (LD_PRELOAD), by name.
PRELOAD_LIBRARIES = {
    "jemalloc": "libjemalloc.so.2",
    "tcmalloc": "libtcmalloc_minimal.so.4",
}
_LIBRARY_DIRS = (
    "/usr/lib/x86_64-linux-gnu",
    "/usr/lib/aarch64-linux-gnu",
    "/usr/lib64",
    "/usr/lib",
    "/usr/local/lib",
)


def find_library(name: str) -> str | None:
    """The path of allocator ``name``'s shared library, or None if it is not installed."""
    filename = PRELOAD_LIBRARIES[name]
    for directory in _LIBRARY_DIRS:
        path = os.path.join(directory, filename)
        if os.path.exists(path):
            return path
    return None


def accelerator_plugin_installed() -> bool:
    """Whether JAX could find a TPU or GPU here (libtpu, or a ``jax_plugins`` module)."""
    if importlib.util.find_spec("libtpu") is not None:
        return True
    plugins = importlib.util.find_spec("jax_plugins")
    return plugins is not None and any(pkgutil.iter_modules(plugins.submodule_search_locations))


MODES = ("auto", "on", "off", *PRELOAD_LIBRARIES)
_PRELOADED = "CURSOR_RL_PRELOADED"  # set across preload()'s re-execution


def mode(environ: Mapping[str, str] = os.environ) -> str:
    value = environ.get(ENV, "auto").strip().lower()
    if value not in MODES:
        raise ValueError(f"{ENV}={environ[ENV]!r}: expected one of {', '.join(MODES)}")
    return value


def wanted(
    environ: Mapping[str, str] = os.environ, accelerator=accelerator_plugin_installed
) -> bool:
    """Whether the glibc settings should apply, from CURSOR_RL_HOST_MALLOC and
    JAX_PLATFORMS (a preloaded allocator, when active, overrides them: ``configure``)."""
    value = mode(environ)
    if value == "on":
        return True
    if value != "auto":
        return False
    platforms = environ.get("JAX_PLATFORMS", "").strip()
    if platforms:
        return platforms.split(",")[0].strip().lower() == "cpu"
    return not accelerator()


def preloaded() -> str | None:
    """The name of the preloaded allocator serving this process's malloc, if any."""
    try:
        with open("/proc/self/maps") as f:
            maps = f.read()
    except OSError:
        return None
    for name, filename in PRELOAD_LIBRARIES.items():
        if "/" + filename in maps:
            return name
    return None


def preload_wanted(
    environ: Mapping[str, str] = os.environ, accelerator=accelerator_plugin_installed
) -> str | None:
    """The allocator ``preload()`` should load (None: keep glibc)."""
    value = mode(environ)
    if value in PRELOAD_LIBRARIES:
        return value
    if value == "auto" and wanted(environ, accelerator):
        return "tcmalloc"
    return None


def preload(environ: Mapping[str, str] = os.environ, argv: list[str] | None = None) -> str | None:
    """Re-executes this process with the wanted allocator preloaded, if it is installed
    and not loaded yet; returns the allocator now serving malloc (None: glibc).

    Call it first thing in an entry point (nothing is lost by re-executing then).
    After the re-execution it removes ``LD_PRELOAD`` from ``os.environ``, so the
    process's own subprocesses start with glibc.
    """
    name = preload_wanted(environ)
    active = preloaded()
    if environ is os.environ and os.environ.get(_PRELOADED):
        # Second life: leave children the environment the user gave us.
        previous = os.environ.pop(_PRELOADED)
        if previous == "-":
            os.environ.pop("LD_PRELOAD", None)
        else:
            os.environ["LD_PRELOAD"] = previous
        if name is not None and active != name:
            print(f"[host_malloc] {name} was preloaded but is not in use", file=sys.stderr)
        return active
    if name is None or active is not None:
        return active
    path = find_library(name)
    if path is None:
        if mode(environ) == name:
            raise RuntimeError(f"{ENV}={name}: {PRELOAD_LIBRARIES[name]} is not installed")
        return None
    env = dict(environ)
    env[_PRELOADED] = env.get("LD_PRELOAD") or "-"
    env["LD_PRELOAD"] = " ".join(p for p in (path, env.get("LD_PRELOAD", "")) if p)
    argv = list(sys.orig_argv if argv is None else argv)
    sys.stdout.flush()
    sys.stderr.flush()
    os.execve(sys.executable, [sys.executable, *argv[1:]], env)
    return None  # not reached


def configure(environ: Mapping[str, str] = os.environ) -> bool:
    """Applies the glibc settings when wanted, the C library is glibc and no allocator
    is preloaded; returns whether it did."""
    global applied
    if applied or not wanted(environ) or platform.libc_ver()[0] != "glibc":
        return applied
    if preloaded() is not None:
        return False
    mallopt = ctypes.CDLL(None).mallopt
    mallopt.argtypes = (ctypes.c_int, ctypes.c_int)
    ok = [
        mallopt(_M_ARENA_MAX, 1),
        mallopt(_M_MMAP_MAX, 0),
        mallopt(_M_TRIM_THRESHOLD, NO_TRIM),
    ]
    applied = all(ok)
    return applied
