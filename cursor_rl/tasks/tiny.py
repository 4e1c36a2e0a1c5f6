"""The ``tiny`` family: small generated modules a tiny CPU model can learn to fix.

A later issue trains a model of a few million parameters (a byte-level BPE of a few
thousand tokens, a context of one or two thousand tokens) and must show RL raising
its held-out pass@1. Real stdlib tasks are far beyond it, so this family supplies
tasks of the same *kind* at a learnable size. It is not a separate toy path: a tiny
module is an ordinary ``SourceRepo`` (one code file, one unittest file) that goes
through the same generators (feature removal, bug injection, refactor), the same
validation in the sandbox and the same grader, and becomes the same record.

Design choices:

1. **Procedural, seeded.** ``tiny_repo(seed)`` draws 3-5 functions from
   ``TEMPLATES`` (arithmetic, string and list operations, simple conditionals and
   loops, one function that calls another), each with drawn names and constants, so
   seeds give hundreds of thousands of distinct modules. The same seed always gives
   the same module.
2. **The docstring is the specification.** Each function's docstring states exactly
   what it returns (``Return x multiplied by 3, plus 7.``), so a feature-removal
   task is solvable from the prompt alone, as a real one is from documentation.
3. **Expected values are computed, not written.** The test inputs are drawn per
   function; the expected outputs come from running the generated function, so a
   template cannot disagree with its tests.
4. **Small and fast.** Bodies are 1-4 lines; each function has two test methods of
   two assertions; a module's whole suite runs in milliseconds.
5. **Split by seed** (``cursor_rl.tasks.splits.TINY_TRAIN_SEEDS`` /
   ``TINY_BENCH_SEEDS``); both splits share templates (what a tiny model can
   transfer) but never a module.

Pure Python, no JAX.
"""

from __future__ import annotations

import dataclasses
import random
import sys
import types
from collections.abc import Callable, Iterator

from cursor_rl.tasks import environments, splits
from cursor_rl.tasks.generators.base import SourceRepo

_NOUNS = (
    "grade", "price", "score", "order", "point", "vote", "step", "team", "card", "note",
    "label", "item", "stock", "budget", "ticket", "lap", "page", "seat", "coin", "box",
    "task", "level", "reading", "bonus", "rating", "token", "sample", "batch", "trip", "meal",
)  # fmt: skip
_MODULE_NOUNS = (
    "grades", "prices", "scores", "orders", "points", "votes", "steps", "teams", "cards",
    "notes", "labels", "items", "stocks", "budgets", "tickets", "laps", "pages", "seats",
    "coins", "boxes", "tasks_util", "levels", "readings", "bonuses", "ratings", "tokens_util",
    "samples", "batches", "trips", "meals",
)  # fmt: skip
_WORDS = ("red", "blue", "cat", "sun", "tree", "box", "key", "map", "dot", "owl", "ink", "fox")


@dataclasses.dataclass(frozen=True)
class TinyFunction:
    """One generated function.

    Attributes:
      name: the function name.
      params: its parameter names.
      doc: its one-line docstring (the specification).
      body: its body lines, unindented.
      cases: argument tuples the tests call it with.
      calls: the name of another module function it calls, if any.
    """

    name: str
    params: tuple[str, ...]
    doc: str
    body: tuple[str, ...]
    cases: tuple[tuple, ...]
    calls: str | None = None

    def source(self) -> str:
        lines = [f"def {self.name}({', '.join(self.params)}):", f'    """{self.doc}"""']
        lines += ["    " + line for line in self.body]
        return "\n".join(lines)


# A template: (rng, noun) -> TinyFunction. The helper draws a name from patterns.
Template = Callable[[random.Random, str], TinyFunction]
TEMPLATES: dict[str, Template] = {}


def _template(name: str):
    def wrap(fn: Template) -> Template:
        TEMPLATES[name] = fn
        return fn

    return wrap


def _name(rng: random.Random, noun: str, *patterns: str) -> str:
    return rng.choice(patterns).format(noun=noun)


def _ints(rng: random.Random, n: int, lo: int = -9, hi: int = 20) -> list[int]:
    return [rng.randint(lo, hi) for _ in range(n)]


def _int_cases(rng, n=4, lo=-9, hi=20):
    return tuple((x,) for x in _ints(rng, n, lo, hi))


def _word(rng: random.Random) -> str:
    return rng.choice(_WORDS)


def _text(rng: random.Random) -> str:
    words = [rng.choice(_WORDS) for _ in range(rng.randint(1, 3))]
    return " ".join(words)


def _list_cases(rng, n=4, min_len=0):
    return tuple((_ints(rng, rng.randint(min_len, 5), -5, 12),) for _ in range(n))


# ---- numbers ----


@_template("affine")
def _affine(rng, noun):
    a, b = rng.randint(2, 9), rng.randint(1, 20)
    return TinyFunction(
        _name(rng, noun, "scale_{noun}", "adjust_{noun}", "{noun}_value"),
        ("x",),
        f"Return x multiplied by {a}, plus {b}.",
        (f"return x * {a} + {b}",),
        _int_cases(rng),
    )


@_template("clamp")
def _clamp(rng, noun):
    lo = rng.randint(0, 5)
    hi = lo + rng.randint(3, 10)
    return TinyFunction(
        _name(rng, noun, "clamp_{noun}", "limit_{noun}", "bounded_{noun}"),
        ("x",),
        f"Return x limited to the range {lo} to {hi} (inclusive).",
        (f"return max({lo}, min(x, {hi}))",),
        ((lo - 3,), (hi + 4,), (lo + 1,), (rng.randint(lo, hi),)),
    )


@_template("divisible")
def _divisible(rng, noun):
    k = rng.randint(2, 7)
    cases = ((k * rng.randint(1, 4),), (k * rng.randint(1, 4) + 1,), (0,), (rng.randint(1, 30),))
    return TinyFunction(
        _name(rng, noun, "{noun}_fits", "is_{noun}_multiple", "{noun}_divides"),
        ("x",),
        f"Return True if x is divisible by {k}, else False.",
        (f"return x % {k} == 0",),
        cases,
    )


@_template("distance")
def _distance(rng, noun):
    k = rng.randint(1, 15)
    return TinyFunction(
        _name(rng, noun, "{noun}_gap", "distance_to_{noun}", "{noun}_offset"),
        ("x",),
        f"Return the distance between x and {k} (always zero or positive).",
        (f"return abs(x - {k})",),
        ((k - 4,), (k + 3,), (k,), (rng.randint(-5, 25),)),
    )


@_template("threshold")
def _threshold(rng, noun):
    t = rng.randint(1, 15)
    hi, lo = rng.choice((("high", "low"), ("big", "small"), ("pass", "fail"), ("yes", "no")))
    return TinyFunction(
        _name(rng, noun, "{noun}_label", "classify_{noun}", "{noun}_kind"),
        ("x",),
        f'Return "{hi}" if x is at least {t}, otherwise "{lo}".',
        (f"if x >= {t}:", f'    return "{hi}"', f'return "{lo}"'),
        ((t,), (t - 1,), (t + rng.randint(1, 9),), (t - rng.randint(2, 9),)),
    )


@_template("sign")
def _sign(rng, noun):
    return TinyFunction(
        _name(rng, noun, "{noun}_sign", "sign_of_{noun}", "{noun}_direction"),
        ("x",),
        "Return 1 if x is positive, -1 if x is negative, and 0 if x is zero.",
        ("if x > 0:", "    return 1", "if x < 0:", "    return -1", "return 0"),
        ((rng.randint(1, 9),), (-rng.randint(1, 9),), (0,), (rng.randint(-9, 9),)),
    )


@_template("halve")
def _halve(rng, noun):
    k = rng.randint(1, 9)
    return TinyFunction(
        _name(rng, noun, "half_{noun}", "{noun}_midpoint", "split_{noun}"),
        ("x",),
        f"Return x plus {k}, divided by 2 and rounded down.",
        (f"return (x + {k}) // 2",),
        _int_cases(rng),
    )


# ---- two numbers ----


@_template("product_minus")
def _product_minus(rng, noun):
    k = rng.randint(1, 9)
    return TinyFunction(
        _name(rng, noun, "{noun}_area", "combine_{noun}", "{noun}_product"),
        ("a", "b"),
        f"Return a times b, minus {k}.",
        (f"return a * b - {k}",),
        tuple((rng.randint(-5, 9), rng.randint(-5, 9)) for _ in range(4)),
    )


@_template("larger")
def _larger(rng, noun):
    return TinyFunction(
        _name(rng, noun, "larger_{noun}", "best_{noun}", "max_{noun}"),
        ("a", "b"),
        "Return the larger of a and b.",
        ("if a > b:", "    return a", "return b"),
        ((3, 8), (9, 2), (-4, -7), (rng.randint(-9, 9), rng.randint(-9, 9))),
    )


@_template("difference")
def _difference(rng, noun):
    return TinyFunction(
        _name(rng, noun, "{noun}_change", "{noun}_delta", "subtract_{noun}"),
        ("a", "b"),
        "Return a minus b.",
        ("return a - b",),
        tuple((rng.randint(-9, 20), rng.randint(-9, 20)) for _ in range(4)),
    )


@_template("safe_divide")
def _safe_divide(rng, noun):
    d = rng.randint(-1, 1)
    return TinyFunction(
        _name(rng, noun, "{noun}_ratio", "share_{noun}", "{noun}_per_unit"),
        ("a", "b"),
        f"Return a divided by b, rounded down; return {d} when b is 0.",
        ("if b == 0:", f"    return {d}", "return a // b"),
        ((rng.randint(5, 30), rng.randint(2, 6)), (rng.randint(1, 9), 0), (7, 2), (-9, 4)),
    )


# ---- strings ----


@_template("shout")
def _shout(rng, noun):
    suffix = rng.choice(("!", "?", "!!", "."))
    return TinyFunction(
        _name(rng, noun, "shout_{noun}", "loud_{noun}", "{noun}_alert"),
        ("s",),
        f'Return s in upper case followed by "{suffix}".',
        (f'return s.upper() + "{suffix}"',),
        (*[(_text(rng),) for _ in range(3)], ("",)),
    )


@_template("reverse_text")
def _reverse_text(rng, noun):
    return TinyFunction(
        _name(rng, noun, "reverse_{noun}", "{noun}_backwards", "flip_{noun}"),
        ("s",),
        "Return s with its characters in reverse order.",
        ("return s[::-1]",),
        (*[(_text(rng),) for _ in range(3)], ("ab",)),
    )


@_template("tidy")
def _tidy(rng, noun):
    return TinyFunction(
        _name(rng, noun, "tidy_{noun}", "clean_{noun}", "normalize_{noun}"),
        ("s",),
        "Return s without leading or trailing spaces, in lower case.",
        ("return s.strip().lower()",),
        (("  Red Cat ",), ("SUN",), (" " + _text(rng).upper(),), ("ok  ",)),
    )


@_template("prefix")
def _prefix(rng, noun):
    p = rng.choice(("id-", "x_", "#", "v", "tag:"))
    return TinyFunction(
        _name(rng, noun, "tag_{noun}", "{noun}_key", "mark_{noun}"),
        ("s",),
        f'Return s with "{p}" in front of it.',
        (f'return "{p}" + s',),
        (*[(_word(rng),) for _ in range(3)], ("",)),
    )


@_template("count_char")
def _count_char(rng, noun):
    ch = rng.choice("aeiot")
    return TinyFunction(
        _name(rng, noun, "count_{noun}_marks", "{noun}_hits", "tally_{noun}"),
        ("s",),
        f'Return how many times the letter "{ch}" occurs in s.',
        (f'return s.count("{ch}")',),
        ((f"{ch}b{ch}",), (_text(rng),), ("",), (ch * rng.randint(1, 4),)),
    )


@_template("word_count")
def _word_count(rng, noun):
    return TinyFunction(
        _name(rng, noun, "{noun}_words", "count_{noun}_words", "{noun}_length"),
        ("s",),
        "Return the number of words in s (words are separated by whitespace).",
        ("return len(s.split())",),
        ((_text(rng),), ("",), ("  one  two ",), (_text(rng) + " " + _text(rng),)),
    )


@_template("head")
def _head(rng, noun):
    n = rng.randint(1, 4)
    return TinyFunction(
        _name(rng, noun, "short_{noun}", "{noun}_head", "abbreviate_{noun}"),
        ("s",),
        f"Return the first {n} characters of s (all of s if it is shorter).",
        (f"return s[:{n}]",),
        ((_text(rng),), ("ab",), ("",), ("abcdefgh",)),
    )


@_template("starts_with")
def _starts_with(rng, noun):
    p = _word(rng)[:2]
    return TinyFunction(
        _name(rng, noun, "is_{noun}_code", "{noun}_matches", "has_{noun}_prefix"),
        ("s",),
        f'Return True if s starts with "{p}", else False.',
        (f'return s.startswith("{p}")',),
        ((p + "zz",), ("zz" + p,), ("",), (_word(rng),)),
    )


@_template("join_words")
def _join_words(rng, noun):
    sep = rng.choice(("-", "_", "+", "/"))
    return TinyFunction(
        _name(rng, noun, "{noun}_slug", "join_{noun}", "{noun}_path"),
        ("s",),
        f'Return the words of s joined by "{sep}".',
        (f'return "{sep}".join(s.split())',),
        ((_text(rng),), ("one",), ("  a  b c ",), (_text(rng) + " " + _word(rng),)),
    )


@_template("vowels")
def _vowels(rng, noun):
    return TinyFunction(
        _name(rng, noun, "{noun}_vowels", "count_{noun}_vowels", "vowels_in_{noun}"),
        ("s",),
        'Return how many characters of s are lower-case vowels ("aeiou").',
        (
            "total = 0",
            "for ch in s:",
            '    if ch in "aeiou":',
            "        total += 1",
            "return total",
        ),
        ((_text(rng),), ("",), ("AEIOU ae",), (_text(rng),)),
    )


# ---- lists ----


@_template("scale_all")
def _scale_all(rng, noun):
    k = rng.randint(2, 5)
    return TinyFunction(
        _name(rng, noun, "scale_{noun}s", "{noun}s_times", "boost_{noun}s"),
        ("xs",),
        f"Return a new list with every number of xs multiplied by {k}.",
        (f"return [x * {k} for x in xs]",),
        _list_cases(rng),
    )


@_template("above")
def _above(rng, noun):
    t = rng.randint(0, 6)
    return TinyFunction(
        _name(rng, noun, "big_{noun}s", "{noun}s_above", "keep_{noun}s"),
        ("xs",),
        f"Return the numbers of xs that are greater than {t}, in order.",
        (f"return [x for x in xs if x > {t}]",),
        _list_cases(rng),
    )


@_template("first_or")
def _first_or(rng, noun):
    d = rng.randint(-1, 9)
    return TinyFunction(
        _name(rng, noun, "first_{noun}", "{noun}_head", "lead_{noun}"),
        ("xs",),
        f"Return the first number of xs, or {d} if xs is empty.",
        ("if not xs:", f"    return {d}", "return xs[0]"),
        ((_ints(rng, 3),), ([],), (_ints(rng, 1),), (_ints(rng, 4),)),
    )


@_template("spread")
def _spread(rng, noun):
    return TinyFunction(
        _name(rng, noun, "{noun}_spread", "{noun}_range", "{noun}_span"),
        ("xs",),
        "Return the largest number of xs minus the smallest (xs is never empty).",
        ("return max(xs) - min(xs)",),
        _list_cases(rng, min_len=1),
    )


@_template("smallest")
def _smallest(rng, noun):
    n = rng.randint(1, 3)
    return TinyFunction(
        _name(rng, noun, "lowest_{noun}s", "{noun}_bottom", "cheapest_{noun}s"),
        ("xs",),
        f"Return the {n} smallest numbers of xs in increasing order (fewer if xs is shorter).",
        (f"return sorted(xs)[:{n}]",),
        _list_cases(rng),
    )


@_template("longer_than")
def _longer_than(rng, noun):
    n = rng.randint(1, 4)
    return TinyFunction(
        _name(rng, noun, "many_{noun}s", "{noun}s_full", "enough_{noun}s"),
        ("xs",),
        f"Return True if xs has more than {n} items, else False.",
        (f"return len(xs) > {n}",),
        ((list(range(n)),), (list(range(n + 1)),), ([],), (_ints(rng, rng.randint(0, 6)),)),
    )


@_template("sum_even")
def _sum_even(rng, noun):
    return TinyFunction(
        _name(rng, noun, "even_{noun}_total", "sum_even_{noun}s", "{noun}_even_sum"),
        ("xs",),
        "Return the sum of the even numbers of xs.",
        ("total = 0", "for x in xs:", "    if x % 2 == 0:", "        total += x", "return total"),
        _list_cases(rng),
    )


@_template("count_above")
def _count_above(rng, noun):
    t = rng.randint(0, 6)
    return TinyFunction(
        _name(rng, noun, "count_big_{noun}s", "{noun}s_over", "num_high_{noun}s"),
        ("xs",),
        f"Return how many numbers of xs are greater than {t}.",
        ("count = 0", "for x in xs:", f"    if x > {t}:", "        count += 1", "return count"),
        _list_cases(rng),
    )


# Templates whose functions take one int: the composite template applies one of them.
_UNARY_INT = ("affine", "clamp", "distance", "halve", "sign", "threshold")


def _composite(rng: random.Random, noun: str, inner: TinyFunction) -> TinyFunction:
    name = _name(rng, noun, "{noun}_all", "apply_{noun}", "map_{noun}s")
    return TinyFunction(
        name,
        ("xs",),
        f"Return a list with {inner.name}(x) for every number x of xs.",
        (f"return [{inner.name}(x) for x in xs]",),
        (*_list_cases(rng, n=2, min_len=1), ([],)),
        calls=inner.name,
    )


def tiny_functions(seed: int) -> tuple[str, list[TinyFunction]]:
    """The module name and functions of tiny module ``seed`` (deterministic)."""
    rng = random.Random(f"tiny:{seed}")
    module = rng.choice(_MODULE_NOUNS)
    count = rng.randint(3, 5)
    names = rng.sample(sorted(TEMPLATES), count)
    nouns = rng.sample(_NOUNS, count + 1)
    functions, unary = [], []
    for template, noun in zip(names, nouns):
        fn = TEMPLATES[template](rng, noun)
        if any(fn.name == other.name for other in functions):
            continue
        functions.append(fn)
        if template in _UNARY_INT:
            unary.append(fn)
    if unary and rng.random() < 0.5:
        functions.append(_composite(rng, nouns[-1], rng.choice(unary)))
    return module, functions


def _expected(module_source: str, module: str) -> dict[str, Callable]:
    namespace = types.ModuleType(module)
    exec(compile(module_source, f"{module}.py", "exec"), namespace.__dict__)
    return namespace.__dict__


def _test_source(module: str, functions: list[TinyFunction], source: str) -> str:
    env = _expected(source, module)
    lines = ["import unittest", "", f"import {module}", ""]
    for fn in functions:
        camel = "".join(part.capitalize() for part in fn.name.split("_"))
        lines += ["", f"class Test{camel}(unittest.TestCase):"]
        halves = (fn.cases[: len(fn.cases) // 2 or 1], fn.cases[len(fn.cases) // 2 or 1 :])
        for method, cases in zip(("test_basic", "test_more"), halves):
            if not cases:
                continue
            lines.append(f"    def {method}(self):")
            for args in cases:
                call = f"{module}.{fn.name}({', '.join(repr(a) for a in args)})"
                lines.append(f"        self.assertEqual({call}, {env[fn.name](*args)!r})")
            lines.append("")
    lines += ["", 'if __name__ == "__main__":', "    unittest.main()"]
    return "\n".join(lines) + "\n"


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
    module, functions = tiny_functions(seed)
    if module in sys.stdlib_module_names:
        raise AssertionError(f"tiny module name {module!r} shadows the standard library")
    source = f'"""Small helpers for {module.replace("_util", "")}."""\n\n\n'
    source += "\n\n\n".join(fn.source() for fn in functions) + "\n"
    tests = _test_source(module, functions, source)
    test_file = f"test_{module}.py"
    return SourceRepo(
        name=f"tiny-{seed:07d}",
        tree={f"{module}.py": source, test_file: tests},
        test_files=(test_file,),
        target_files={f"{module}.py": module},
        test_framework="unittest",
        test_command=f"python -m unittest {test_file[:-3]}",
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
