"""The train / private-benchmark split of the code the project learns from, in one place.

Composer 2 was measured on a private benchmark that the model never saw in any
form. Here the benchmark is built from *different code* than the training tasks:

1. **Standard library.** ``BENCH_MODULES`` are the CPython modules whose tasks form
   the held-out benchmark; ``TRAIN_MODULES`` are the modules training tasks come
   from. The two are disjoint. The pretraining corpus (``cursor_rl.data.sources``)
   imports ``BENCH_MODULES`` and drops those modules, their pure-Python twins and
   their tests, so neither a benchmark solution nor its hidden tests reach
   pretraining. Training modules stay in the corpus: a model may have read the
   code it is later asked to repair, which is how real repositories are too.
   The contamination check (``cursor_rl.tasks.contamination``) then measures what
   exclusion by name cannot: n-gram overlap between benchmark solutions and both
   the corpus and the training tasks.
2. **Tiny family.** Procedurally generated single-file modules
   (``cursor_rl.data.tiny_modules``) are split by generator seed: training modules come
   from ``TINY_TRAIN_SEEDS`` and benchmark modules from ``TINY_BENCH_SEEDS``.
   Both draw from the same function templates (a tiny model could not otherwise
   transfer) but with independently drawn names, constants and module mixes, and
   the benchmark build (``--decontaminate_against=TRAIN
   --decontaminate_threshold=0.99``) drops a task whose solution occurs whole in the
   training tasks, so disjoint seeds are not the only thing keeping the split apart.
3. **Other repositories** (a local path, a PyPI sdist) are one split as a whole:
   the build is told which with ``--split``; a repository is never divided between
   train and bench, since files of one project share idioms and helpers.

The modules were chosen from stdlib modules whose unit tests run in about a second
in isolation, exercise the pure-Python code (not a C accelerator) and do not need
the network, so a task validates quickly in the sandbox. Modules the interpreter
imports at start-up (``random``, via site-packages' ``.pth`` hooks on this machine)
are left out: their tests would exercise the interpreter's copy, not the task's
(validation's sensitivity probe rejects such a repository anyway).

It sits in ``cursor_rl.data`` because both the pretraining corpus and the task factory
(``cursor_rl.tasks``, a floor above) follow it; the data pipeline's workers import it,
so it must stay free of heavy imports.
"""

from __future__ import annotations

# Held-out benchmark: never in pretraining, never in training tasks.
BENCH_MODULES: tuple[str, ...] = (
    "colorsys",
    "fractions",
    "getopt",
    "graphlib",
    "netrc",
    "quopri",
    "shlex",
    "string",
    "textwrap",
)

# Training-task sources: fast, isolated, pure-Python tests; disjoint from BENCH_MODULES.
TRAIN_MODULES: tuple[str, ...] = (
    "base64",
    "bdb",
    "bisect",
    "calendar",
    "cmd",
    "code",
    "codeop",
    "configparser",
    "copy",
    "csv",
    "filecmp",
    "fileinput",
    "gettext",
    "glob",
    "gzip",
    "heapq",
    "hmac",
    "imghdr",
    "mailcap",
    "mimetypes",
    "optparse",
    "pickletools",
    "pkgutil",
    "plistlib",
    "sched",
    "secrets",
    "shelve",
    "statistics",
    "sunau",
    "symtable",
    "timeit",
    "uu",
    "uuid",
    "wave",
    "xdrlib",
    "zipapp",
)

SPLITS: tuple[str, ...] = ("train", "bench")

# Tiny-family generator seeds per split (half-open ranges, disjoint).
TINY_TRAIN_SEEDS = range(0, 1_000_000)
TINY_BENCH_SEEDS = range(1_000_000, 2_000_000)


def stdlib_modules(split: str) -> tuple[str, ...]:
    """The stdlib modules tasks of ``split`` are built from.

    Args:
      split: ``"train"`` or ``"bench"``.

    Returns:
      The module names, sorted.
    """
    if split == "train":
        return TRAIN_MODULES
    if split == "bench":
        return BENCH_MODULES
    raise ValueError(f"unknown split {split!r}; expected one of {SPLITS}")


def tiny_seeds(split: str) -> range:
    """The tiny-family generator seeds reserved for ``split``."""
    if split == "train":
        return TINY_TRAIN_SEEDS
    if split == "bench":
        return TINY_BENCH_SEEDS
    raise ValueError(f"unknown split {split!r}; expected one of {SPLITS}")
