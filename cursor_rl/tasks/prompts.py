"""User prompts for tasks: feature requests, bug reports, refactor requests.

Two styles: ``full`` for real repositories (signature, docstring, call sites, failing
tests with their messages) and ``short`` for the tiny family, whose model has a
context of one or two thousand tokens and must spend it on the episode, not on the
request.

What a prompt never contains: the removed code, the location of an injected bug,
or the hidden tests' source. A feature prompt states *what* to build (signature,
documentation, how callers use it); a bug report states *symptoms* (which tests fail
and how); a refactor request states the change and that behaviour must not move.

Pure Python, no JAX.
"""

from __future__ import annotations

import re
import textwrap
from collections.abc import Sequence

_DETAIL_LINES = 3  # lines of each failure message quoted in a full bug report
_DETAIL_CHARS = 300
_MAX_FAILURES = 3


def _indent(text: str, prefix: str = "    ") -> str:
    return textwrap.indent(text, prefix, lambda line: True)


def _docstring_block(docstring: str | None) -> str:
    if not docstring:
        return "(no docstring)"
    return '"""' + textwrap.dedent(docstring).strip("\n") + '"""'


def feature_prompt(
    *,
    kind: str,
    symbol: str,
    file: str,
    header: str,
    docstring: str | None,
    call_sites: Sequence[str],
    style: str,
    members: Sequence[tuple[str, str | None]] = (),
) -> str:
    """A request to re-implement a removed function, class or module.

    Args:
      kind: ``function``, ``method``, ``class`` or ``module``.
      symbol: the name shown (``wrap``, ``TextWrapper._split``, ``mod``).
      file: the file to work in.
      header: the ``def``/``class`` line(s) as written.
      docstring: the removed item's docstring.
      call_sites: ``path:line: code`` lines that use it.
      style: ``full`` or ``short``.
      members: for classes and modules, each member's header and docstring.

    Returns:
      The prompt text.
    """
    if style == "short":
        where = "is missing" if kind in ("class", "module") else "raises NotImplementedError"
        spec = header + "\n    " + _docstring_block(docstring) if docstring else header
        return f"In `{file}`, `{symbol}` {where}. Implement it:\n{spec}"
    if kind in ("function", "method"):
        intro = (
            f"The {kind} `{symbol}` in `{file}` has lost its implementation: its body now "
            "only raises NotImplementedError. Implement it so that it does what its "
            "signature, documentation and callers expect."
        )
    elif kind == "class":
        intro = (
            f"The class `{symbol}` has been deleted from `{file}`. Re-create it with the "
            "interface described below so that the rest of the code works again."
        )
    else:
        intro = (
            f"The module `{file}` has been deleted. Re-create it with the interface "
            "described below so that the code that imports it works again."
        )
    parts = [intro, "", "Signature:", _indent(header), "", "Documentation:"]
    parts.append(_indent(_docstring_block(docstring)))
    if members:
        parts += ["", "Members:"]
        for member_header, member_doc in members:
            parts.append(_indent(member_header))
            if member_doc:
                parts.append(_indent(_docstring_block(member_doc), "        "))
    if call_sites:
        parts += ["", "Where it is used:"] + [_indent(site) for site in call_sites]
    parts += [
        "",
        "Keep the rest of the code's behaviour unchanged. The test suite is not part of "
        "the repository you see; it will be run after you submit.",
    ]
    return "\n".join(parts)


_EXCEPTION_LINE = re.compile(r"^[A-Za-z_][\w.]*(Error|Exception|Exit|Interrupt)\b")


def _failure_summary(detail: str, max_lines: int) -> str:
    """The lines of a failure report that say what went wrong.

    pytest marks its explanation with ``E``. A unittest traceback gives the failing
    line of the test, then the exception and its message (for a list or string
    mismatch, a diff follows, which is kept only as room allows).
    """
    lines = [line.rstrip() for line in detail.strip().splitlines() if line.strip()]
    explained = [line[1:].strip() for line in lines if line.startswith("E ")]
    if explained:
        keep = "\n".join(line for line in explained[:max_lines] if line)
    else:
        lines = [line.strip() for line in lines if not set(line.strip()) <= set("^~ ")]
        starts = [i for i, line in enumerate(lines) if _EXCEPTION_LINE.match(line)]
        if starts:
            first = max(starts[-1] - 1, 0)  # the failing line, then the exception
            if lines[first].startswith(("File ", "Traceback")):
                first += 1
            keep = "\n".join(lines[first : first + max_lines])
        else:
            keep = "\n".join(lines[-max_lines:])
    return keep if len(keep) <= _DETAIL_CHARS else keep[: _DETAIL_CHARS - 3] + "..."


def bug_prompt(*, module: str, failures: Sequence[tuple[str, str]], style: str) -> str:
    """A bug report built from the tests the injected bug makes fail.

    Args:
      module: the module the report is about (``textwrap``, ``grades.py``).
      failures: ``(test_id, failure detail)`` pairs from validation.
      style: ``full`` or ``short``.

    Returns:
      The prompt text.
    """
    shown = list(failures[:_MAX_FAILURES])
    if style == "short":
        # The failing assertion line and its message: a one-line reproducer.
        test_id, detail = shown[0]
        return f"Bug: {test_id} fails:\n{_failure_summary(detail, 2)}\nFix `{module}`."
    parts = [
        f"Bug report: `{module}` misbehaves since a recent change. "
        f"{len(failures)} test(s) of its suite now fail, for example:",
        "",
    ]
    for test_id, detail in shown:
        parts.append(f"- {test_id}")
        parts.append(_indent(_failure_summary(detail, _DETAIL_LINES)))
    parts += [
        "",
        "Find the cause in the code and fix it, without changing behaviour that is "
        "correct. The test suite is not part of the repository you see; it will be "
        "run after you submit.",
    ]
    return "\n".join(parts)
