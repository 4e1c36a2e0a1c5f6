"""Task generators by name: feature removal, bug injection, refactors.

    from cursor_rl.tasks import generators
    generators.names("bug")            # ['drop_condition', 'flip_comparison', ...]
    generators.get("off_by_one").fn(repo)  # -> list[Candidate]

Importing this package registers every generator (see ``base.register``).
"""

from cursor_rl.tasks.generators import bugs, feature, refactor
from cursor_rl.tasks.generators.base import (
    Candidate,
    GeneratorSpec,
    SourceRepo,
    get,
    names,
    register,
)

__all__ = [
    "Candidate",
    "GeneratorSpec",
    "SourceRepo",
    "bugs",
    "feature",
    "get",
    "names",
    "refactor",
    "register",
]
