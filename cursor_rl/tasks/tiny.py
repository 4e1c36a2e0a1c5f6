"""The ``tiny`` family's repositories: one generated module and its unit tests each.

The modules come from ``cursor_rl.data.tiny_modules`` (which also feeds them to the
pretraining corpus, train split only); here each becomes an ordinary ``SourceRepo``
(one code file, one unittest file) for the generators, validation and grading, with
the short prompts a tiny model's context allows. Seeds are split by
``cursor_rl.data.splits``.

Pure Python, no JAX.
"""

from __future__ import annotations

from collections.abc import Iterator

from cursor_rl.data import splits, tiny_modules
from cursor_rl.tasks import environments
from cursor_rl.tasks.generators.base import SourceRepo


def tiny_repo(seed: int, *, split: str | None = None) -> SourceRepo:
    """The tiny module of ``seed`` as a repository: ``NAME.py`` and ``test_NAME.py``.

    Args:
      seed: the generator seed.
      split: when given, the seed must lie in that split's range.

    Returns:
      The repository, ready for the task generators.
    """
    if split is not None and seed not in splits.tiny_seeds(split):
        raise ValueError(f"seed {seed} is not in the {split} split's range")
    module = tiny_modules.tiny_module(seed)
    return SourceRepo(
        name=module.id,
        tree={module.code_file: module.source, module.test_file: module.tests},
        test_files=(module.test_file,),
        target_files={module.code_file: module.name},
        test_framework="unittest",
        test_command=f"python -m unittest {module.test_file[:-3]}",
        source="tiny",
        repo=f"tiny:{seed}",
        family="tiny",
        environment=environments.interpreter_environment(),
        prompt_style="short",
    )


def tiny_repos(split: str, *, start: int = 0) -> Iterator[SourceRepo]:
    """Tiny repositories of ``split`` in seed order, from the ``start``-th seed on."""
    seeds = splits.tiny_seeds(split)
    for seed in seeds[start:]:
        yield tiny_repo(seed)
