"""Tiny modules: small generated Python modules, each with its unit tests.

A later issue trains a model of a few million parameters (a byte-level BPE of a few
thousand tokens, a context of one or two thousand tokens) and must show RL raising
its held-out pass@1. Real stdlib tasks are far beyond it, so the ``tiny`` family
supplies code of the same *kind* at a learnable size, in two roles: the pretraining
corpus reads the train split's modules (``cursor_rl.data.sources``, source ``tiny``),
and the task factory turns each module into an ordinary repository
(``cursor_rl.tasks.tiny``) that goes through the same generators (feature removal,
bug injection, refactor), the same validation in the sandbox and the same grader as
any other, and becomes the same record.

Design choices:

1. **Procedural, seeded.** ``tiny_module(seed)`` draws 3-5 functions from
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
5. **Split by seed** (``cursor_rl.data.splits.TINY_TRAIN_SEEDS`` /
   ``TINY_BENCH_SEEDS``); both splits share templates (what a tiny model can
   transfer) but never a module.

Pure Python, no JAX.
"""

from __future__ import annotations

import dataclasses
import random
import sys
import types
from collections.abc import Callable
from typing import Any

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


@dataclasses.dataclass(frozen=True)
class Template:
    """A kind of function, with drawn names and constants.

    Attributes:
      names: name patterns (``{noun}`` is filled with a drawn noun).
      params: parameter names.
      doc: the docstring, formatted with the drawn constants.
      body: body lines, formatted with the drawn constants.
      constants: draws the constants (a dict) from the RNG.
      cases: draws the test inputs (argument tuples) from the RNG and the constants.
    """

    names: tuple[str, ...]
    params: tuple[str, ...]
    doc: str
    body: tuple[str, ...]
    constants: Callable[[random.Random], dict[str, Any]]
    cases: Callable[[random.Random, dict[str, Any]], tuple[tuple, ...]]

    def draw(self, rng: random.Random, noun: str) -> TinyFunction:
        consts = self.constants(rng)
        return TinyFunction(
            rng.choice(self.names).format(noun=noun),
            self.params,
            self.doc.format(**consts),
            tuple(line.format(**consts) for line in self.body),
            self.cases(rng, consts),
        )


def _ints(rng: random.Random, n: int, lo: int = -9, hi: int = 20) -> list[int]:
    return [rng.randint(lo, hi) for _ in range(n)]


def _word(rng: random.Random) -> str:
    return rng.choice(_WORDS)


def _text(rng: random.Random) -> str:
    return " ".join(rng.choice(_WORDS) for _ in range(rng.randint(1, 3)))


def _one_int(rng, consts) -> tuple[tuple, ...]:
    return tuple((x,) for x in _ints(rng, 4))


def _two_ints(rng, consts) -> tuple[tuple, ...]:
    return tuple((rng.randint(-5, 9), rng.randint(-5, 9)) for _ in range(4))


def _lists(rng, consts, n=4, min_len=0) -> tuple[tuple, ...]:
    return tuple((_ints(rng, rng.randint(min_len, 5), -5, 12),) for _ in range(n))


def _texts(rng, consts, *extra: str) -> tuple[tuple, ...]:
    return (*[(_text(rng),) for _ in range(4 - len(extra))], *[(e,) for e in extra])


def _bounds(rng: random.Random) -> dict[str, int]:
    lo = rng.randint(0, 5)
    return {"lo": lo, "hi": lo + rng.randint(3, 10)}


def _labels(rng: random.Random) -> dict[str, Any]:
    hi, lo = rng.choice((("high", "low"), ("big", "small"), ("pass", "fail"), ("yes", "no")))
    return {"hi": hi, "lo": lo, "t": rng.randint(1, 15)}


_none = lambda rng: {}  # a template without constants
_T = Template
# fmt: off
TEMPLATES: dict[str, Template] = {
    # ---- one number ----
    "affine": _T(
        ("scale_{noun}", "adjust_{noun}", "{noun}_value"), ("x",),
        "Return x multiplied by {a}, plus {b}.", ("return x * {a} + {b}",),
        lambda r: {"a": r.randint(2, 9), "b": r.randint(1, 20)}, _one_int),
    "clamp": _T(
        ("clamp_{noun}", "limit_{noun}", "bounded_{noun}"), ("x",),
        "Return x limited to the range {lo} to {hi} (inclusive).",
        ("return max({lo}, min(x, {hi}))",),
        _bounds,
        lambda r, c: ((c["lo"] - 3,), (c["hi"] + 4,), (c["lo"] + 1,),
                      (r.randint(c["lo"], c["hi"]),))),
    "divisible": _T(
        ("{noun}_fits", "is_{noun}_multiple", "{noun}_divides"), ("x",),
        "Return True if x is divisible by {k}, else False.", ("return x % {k} == 0",),
        lambda r: {"k": r.randint(2, 7)},
        lambda r, c: ((c["k"] * r.randint(1, 4),), (c["k"] * r.randint(1, 4) + 1,), (0,),
                      (r.randint(1, 30),))),
    "distance": _T(
        ("{noun}_gap", "distance_to_{noun}", "{noun}_offset"), ("x",),
        "Return the distance between x and {k} (always zero or positive).",
        ("return abs(x - {k})",),
        lambda r: {"k": r.randint(1, 15)},
        lambda r, c: ((c["k"] - 4,), (c["k"] + 3,), (c["k"],), (r.randint(-5, 25),))),
    "threshold": _T(
        ("{noun}_label", "classify_{noun}", "{noun}_kind"), ("x",),
        'Return "{hi}" if x is at least {t}, otherwise "{lo}".',
        ("if x >= {t}:", '    return "{hi}"', 'return "{lo}"'),
        _labels,
        lambda r, c: ((c["t"],), (c["t"] - 1,), (c["t"] + r.randint(1, 9),),
                      (c["t"] - r.randint(2, 9),))),
    "sign": _T(
        ("{noun}_sign", "sign_of_{noun}", "{noun}_direction"), ("x",),
        "Return 1 if x is positive, -1 if x is negative, and 0 if x is zero.",
        ("if x > 0:", "    return 1", "if x < 0:", "    return -1", "return 0"), _none,
        lambda r, c: ((r.randint(1, 9),), (-r.randint(1, 9),), (0,), (r.randint(-9, 9),))),
    "halve": _T(
        ("half_{noun}", "{noun}_midpoint", "split_{noun}"), ("x",),
        "Return x plus {k}, divided by 2 and rounded down.", ("return (x + {k}) // 2",),
        lambda r: {"k": r.randint(1, 9)}, _one_int),
    # ---- two numbers ----
    "product_minus": _T(
        ("{noun}_area", "combine_{noun}", "{noun}_product"), ("a", "b"),
        "Return a times b, minus {k}.", ("return a * b - {k}",),
        lambda r: {"k": r.randint(1, 9)}, _two_ints),
    "larger": _T(
        ("larger_{noun}", "best_{noun}", "max_{noun}"), ("a", "b"),
        "Return the larger of a and b.", ("if a > b:", "    return a", "return b"), _none,
        lambda r, c: ((3, 8), (9, 2), (-4, -7), (r.randint(-9, 9), r.randint(-9, 9)))),
    "difference": _T(
        ("{noun}_change", "{noun}_delta", "subtract_{noun}"), ("a", "b"),
        "Return a minus b.", ("return a - b",), _none, _two_ints),
    "safe_divide": _T(
        ("{noun}_ratio", "share_{noun}", "{noun}_per_unit"), ("a", "b"),
        "Return a divided by b, rounded down; return {d} when b is 0.",
        ("if b == 0:", "    return {d}", "return a // b"),
        lambda r: {"d": r.randint(-1, 1)},
        lambda r, c: ((r.randint(5, 30), r.randint(2, 6)), (r.randint(1, 9), 0), (7, 2), (-9, 4))),
    # ---- strings ----
    "shout": _T(
        ("shout_{noun}", "loud_{noun}", "{noun}_alert"), ("s",),
        'Return s in upper case followed by "{suffix}".', ('return s.upper() + "{suffix}"',),
        lambda r: {"suffix": r.choice(("!", "?", "!!", "."))},
        lambda r, c: _texts(r, c, "")),
    "reverse_text": _T(
        ("reverse_{noun}", "{noun}_backwards", "flip_{noun}"), ("s",),
        "Return s with its characters in reverse order.", ("return s[::-1]",), _none,
        lambda r, c: _texts(r, c, "ab")),
    "tidy": _T(
        ("tidy_{noun}", "clean_{noun}", "normalize_{noun}"), ("s",),
        "Return s without leading or trailing spaces, in lower case.",
        ("return s.strip().lower()",), _none,
        lambda r, c: (("  Red Cat ",), ("SUN",), (" " + _text(r).upper(),), ("ok  ",))),
    "prefix": _T(
        ("tag_{noun}", "{noun}_key", "mark_{noun}"), ("s",),
        'Return s with "{p}" in front of it.', ('return "{p}" + s',),
        lambda r: {"p": r.choice(("id-", "x_", "#", "v", "tag:"))},
        lambda r, c: ((_word(r),), (_word(r),), (_word(r),), ("",))),
    "count_char": _T(
        ("count_{noun}_marks", "{noun}_hits", "tally_{noun}"), ("s",),
        'Return how many times the letter "{ch}" occurs in s.', ('return s.count("{ch}")',),
        lambda r: {"ch": r.choice("aeiot")},
        lambda r, c: ((f"{c['ch']}b{c['ch']}",), (_text(r),), ("",), (c["ch"] * r.randint(1, 4),))),
    "word_count": _T(
        ("{noun}_words", "count_{noun}_words", "{noun}_length"), ("s",),
        "Return the number of words in s (words are separated by whitespace).",
        ("return len(s.split())",), _none,
        lambda r, c: ((_text(r),), ("",), ("  one  two ",), (_text(r) + " " + _text(r),))),
    "head": _T(
        ("short_{noun}", "{noun}_head", "abbreviate_{noun}"), ("s",),
        "Return the first {n} characters of s (all of s if it is shorter).", ("return s[:{n}]",),
        lambda r: {"n": r.randint(1, 4)},
        lambda r, c: ((_text(r),), ("ab",), ("",), ("abcdefgh",))),
    "starts_with": _T(
        ("is_{noun}_code", "{noun}_matches", "has_{noun}_prefix"), ("s",),
        'Return True if s starts with "{p}", else False.', ('return s.startswith("{p}")',),
        lambda r: {"p": _word(r)[:2]},
        lambda r, c: ((c["p"] + "zz",), ("zz" + c["p"],), ("",), (_word(r),))),
    "join_words": _T(
        ("{noun}_slug", "join_{noun}", "{noun}_path"), ("s",),
        'Return the words of s joined by "{sep}".', ('return "{sep}".join(s.split())',),
        lambda r: {"sep": r.choice(("-", "_", "+", "/"))},
        lambda r, c: ((_text(r),), ("one",), ("  a  b c ",), (_text(r) + " " + _word(r),))),
    "vowels": _T(
        ("{noun}_vowels", "count_{noun}_vowels", "vowels_in_{noun}"), ("s",),
        'Return how many characters of s are lower-case vowels ("aeiou").',
        ("total = 0", "for ch in s:", '    if ch in "aeiou":', "        total += 1",
         "return total"),
        _none, lambda r, c: ((_text(r),), ("",), ("AEIOU ae",), (_text(r),))),
    # ---- lists ----
    "scale_all": _T(
        ("scale_{noun}s", "{noun}s_times", "boost_{noun}s"), ("xs",),
        "Return a new list with every number of xs multiplied by {k}.",
        ("return [x * {k} for x in xs]",), lambda r: {"k": r.randint(2, 5)}, _lists),
    "above": _T(
        ("big_{noun}s", "{noun}s_above", "keep_{noun}s"), ("xs",),
        "Return the numbers of xs that are greater than {t}, in order.",
        ("return [x for x in xs if x > {t}]",), lambda r: {"t": r.randint(0, 6)}, _lists),
    "first_or": _T(
        ("first_{noun}", "{noun}_head", "lead_{noun}"), ("xs",),
        "Return the first number of xs, or {d} if xs is empty.",
        ("if not xs:", "    return {d}", "return xs[0]"), lambda r: {"d": r.randint(-1, 9)},
        lambda r, c: ((_ints(r, 3),), ([],), (_ints(r, 1),), (_ints(r, 4),))),
    "spread": _T(
        ("{noun}_spread", "{noun}_range", "{noun}_span"), ("xs",),
        "Return the largest number of xs minus the smallest (xs is never empty).",
        ("return max(xs) - min(xs)",), _none, lambda r, c: _lists(r, c, min_len=1)),
    "smallest": _T(
        ("lowest_{noun}s", "{noun}_bottom", "cheapest_{noun}s"), ("xs",),
        "Return the {n} smallest numbers of xs in increasing order (fewer if xs is shorter).",
        ("return sorted(xs)[:{n}]",), lambda r: {"n": r.randint(1, 3)}, _lists),
    "longer_than": _T(
        ("many_{noun}s", "{noun}s_full", "enough_{noun}s"), ("xs",),
        "Return True if xs has more than {n} items, else False.", ("return len(xs) > {n}",),
        lambda r: {"n": r.randint(1, 4)},
        lambda r, c: ((list(range(c["n"])),), (list(range(c["n"] + 1)),), ([],),
                      (_ints(r, r.randint(0, 6)),))),
    "sum_even": _T(
        ("even_{noun}_total", "sum_even_{noun}s", "{noun}_even_sum"), ("xs",),
        "Return the sum of the even numbers of xs.",
        ("total = 0", "for x in xs:", "    if x % 2 == 0:", "        total += x", "return total"),
        _none, _lists),
    "count_above": _T(
        ("count_big_{noun}s", "{noun}s_over", "num_high_{noun}s"), ("xs",),
        "Return how many numbers of xs are greater than {t}.",
        ("count = 0", "for x in xs:", "    if x > {t}:", "        count += 1", "return count"),
        lambda r: {"t": r.randint(0, 6)}, _lists),
}
# fmt: on

# Templates whose functions take one int: the composite function applies one of them.
_UNARY_INT = ("affine", "clamp", "distance", "halve", "sign", "threshold")


def _composite(rng: random.Random, noun: str, inner: TinyFunction) -> TinyFunction:
    """A function over a list that calls another function of the module (call sites)."""
    return TinyFunction(
        rng.choice(("{noun}_all", "apply_{noun}", "map_{noun}s")).format(noun=noun),
        ("xs",),
        f"Return a list with {inner.name}(x) for every number x of xs.",
        (f"return [{inner.name}(x) for x in xs]",),
        (*_lists(rng, {}, n=2, min_len=1), ([],)),
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
        fn = TEMPLATES[template].draw(rng, noun)
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


@dataclasses.dataclass(frozen=True)
class TinyModule:
    """One generated module and its unit tests.

    Attributes:
      seed: the generator seed.
      name: the module name (never a standard library module's).
      source: the module's code (``NAME.py``).
      tests: its unittest file (``test_NAME.py``).
    """

    seed: int
    name: str
    source: str
    tests: str

    @property
    def id(self) -> str:
        """``tiny-NNNNNNN``: the repository's name and the corpus document's id."""
        return f"tiny-{self.seed:07d}"

    @property
    def code_file(self) -> str:
        return f"{self.name}.py"

    @property
    def test_file(self) -> str:
        return f"test_{self.name}.py"


def tiny_module(seed: int) -> TinyModule:
    """The tiny module of ``seed``, with its tests (deterministic)."""
    module, functions = tiny_functions(seed)
    if module in sys.stdlib_module_names:
        raise AssertionError(f"tiny module name {module!r} shadows the standard library")
    source = f'"""Small helpers for {module.replace("_util", "")}."""\n\n\n'
    source += "\n\n\n".join(fn.source() for fn in functions) + "\n"
    return TinyModule(seed, module, source, _test_source(module, functions, source))
