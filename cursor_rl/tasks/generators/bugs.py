"""Bug injection: small procedural AST transforms that make tests fail.

Each transform is a registered generator that proposes one candidate per place it
applies, inside function and method bodies only (module-level code runs at import,
where a bug would fail every test and leave nothing passing):

* ``flip_comparison``: a comparison operator is reversed or negated
  (``<`` -> ``>``, ``<=`` -> ``>=``, ``==`` -> ``!=``, ``in`` -> ``not in``, ``is`` -> ``is not``);
* ``off_by_one``: an integer literal used as an index, slice bound, comparison
  operand, ``range`` argument or addend moves by one;
* ``drop_condition``: one operand of ``and``/``or`` is dropped, or an ``if`` guard
  is removed so its body always runs;
* ``swap_arguments``: two adjacent positional arguments of a call, or the operands of
  a non-commutative operator (``-``, ``/``, ``//``, ``%``, ``**``, ``<<``, ``>>``), swap;
* ``wrong_return``: a returned boolean is negated, or a function returns one of its
  parameters instead of the value it computed.

The prompt is a bug report written from the failing tests (known only after
validation), never from the transform.
"""

from __future__ import annotations

import ast
import functools
import re
from collections.abc import Callable, Iterator

from cursor_rl.tasks import prompts
from cursor_rl.tasks.generators import base

_FLIP = {
    ast.Lt: ">",
    ast.Gt: "<",
    ast.LtE: ">=",
    ast.GtE: "<=",
    ast.Eq: "!=",
    ast.NotEq: "==",
    ast.In: "not in",
    ast.NotIn: "in",
    ast.Is: "is not",
    ast.IsNot: "is",
}
_OP_PATTERN = re.compile(rb"not\s+in\b|is\s+not\b|<=|>=|==|!=|<|>|\bin\b|\bis\b")
_NON_COMMUTATIVE = (ast.Sub, ast.Div, ast.FloorDiv, ast.Mod, ast.Pow, ast.LShift, ast.RShift)
_ATOMIC = (ast.Name, ast.Attribute, ast.Call, ast.Subscript, ast.Constant, ast.List, ast.Tuple)
_BOOL_CALLS = frozenset({"isinstance", "issubclass", "hasattr", "callable", "any", "all", "bool"})
_NESTED_SCOPES = (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda, ast.ClassDef)

# One proposed change: (a description for logs, the edit of the file's text).
Mutation = tuple[str, base.SourceEdit]


def _walk_body(site: base.FunctionSite) -> Iterator[ast.AST]:
    """Nodes of a function's own body (not its docstring, defaults or nested scopes)."""
    stack = list(reversed(site.body))
    while stack:
        node = stack.pop()
        yield node
        for child in reversed(list(ast.iter_child_nodes(node))):
            if not isinstance(child, _NESTED_SCOPES):
                stack.append(child)


def _parents(site: base.FunctionSite) -> dict[int, ast.AST]:
    parents = {}
    for node in _walk_body(site):
        for child in ast.iter_child_nodes(node):
            parents[id(child)] = node
    return parents


def _bug_candidates(
    repo: base.SourceRepo,
    name: str,
    mutations: Callable[[str, base.FunctionSite], Iterator[Mutation]],
) -> list[base.Candidate]:
    """Applies ``mutations`` at every function of every target file."""
    candidates = []
    visible = repo.visible_files()
    for target in base.target_files(repo):
        path, text, module = target.path, target.text, target.module
        label = path if repo.prompt_style == "short" else target.dotted
        original = ast.dump(module)
        for site in base.function_sites(module):
            call_sites = None
            for description, edit in mutations(text, site):
                broken = edit.apply()
                mutated = base.parse(broken, path)
                # A transform must change the program, not only its spelling.
                if mutated is None or ast.dump(mutated) == original:
                    continue
                if call_sites is None:
                    call_sites = base.count_references(visible, site.name)
                candidates.append(
                    base.Candidate(
                        generator=name,
                        category="bug",
                        file=path,
                        symbol=site.symbol,
                        start_changes={path: broken},
                        prompt=functools.partial(_bug_prompt, label, repo.prompt_style),
                        features={
                            "lines_changed": _lines_changed(text, broken),
                            "call_sites": call_sites,
                            "function_lines": site.node.end_lineno - site.node.lineno + 1,
                        },
                        description=f"{name} in {path}:{site.symbol}: {description}",
                    )
                )
    return candidates


def _bug_prompt(module: str, style: str, failures) -> str:
    return prompts.bug_prompt(module=module, failures=failures, style=style)


def _lines_changed(before: str, after: str) -> int:
    a, b = base.lines_of(before), base.lines_of(after)
    return sum(1 for x, y in zip(a, b) if x != y) + abs(len(a) - len(b))


def _byte_gap(edit: base.SourceEdit, left: ast.AST, right: ast.AST) -> tuple[int, int]:
    return (
        edit.offset(left.end_lineno, left.end_col_offset),
        edit.offset(right.lineno, right.col_offset),
    )


def _paren(text: str, node: ast.AST) -> str:
    return text if isinstance(node, _ATOMIC) else f"({text})"


# ---- flip_comparison ----


def _flip_mutations(text: str, site: base.FunctionSite) -> Iterator[Mutation]:
    data = text.encode("utf-8")
    for node in _walk_body(site):
        if not isinstance(node, ast.Compare):
            continue
        operands = [node.left, *node.comparators]
        for i, op in enumerate(node.ops):
            edit = base.SourceEdit(text)
            start, end = _byte_gap(edit, operands[i], operands[i + 1])
            matches = list(_OP_PATTERN.finditer(data[start:end]))
            if len(matches) != 1:
                continue
            m = matches[0]
            new = _FLIP[type(op)]
            edit.replace_bytes(start + m.start(), start + m.end(), new)
            yield f"line {node.lineno}: {m.group().decode()} -> {new}", edit


@base.register("flip_comparison", "bug")
def flip_comparison(repo: base.SourceRepo) -> list[base.Candidate]:
    """Reverses or negates one comparison operator."""
    return _bug_candidates(repo, "flip_comparison", _flip_mutations)


# ---- off_by_one ----


def _off_by_one_mutations(text: str, site: base.FunctionSite) -> Iterator[Mutation]:
    parents = _parents(site)
    for node in _walk_body(site):
        if not (isinstance(node, ast.Constant) and type(node.value) is int):
            continue
        parent = parents.get(id(node))
        value = node.value
        if isinstance(parent, ast.UnaryOp) and isinstance(parent.op, ast.USub):
            node, value = parent, -value  # -1 is one literal: -1 -> 0 / -2, never "-0"
            parent = parents.get(id(parent))
        counted = (
            isinstance(parent, ast.Slice | ast.Subscript | ast.Compare)
            or (isinstance(parent, ast.BinOp) and isinstance(parent.op, ast.Add | ast.Sub))
            or (
                isinstance(parent, ast.Call)
                and isinstance(parent.func, ast.Name)
                and parent.func.id == "range"
            )
        )
        if not counted or abs(value) > 10_000:
            continue
        for delta in (1, -1):
            new = value + delta
            edit = base.SourceEdit(text).replace_node(node, str(new))
            yield f"line {node.lineno}: {value} -> {new}", edit


@base.register("off_by_one", "bug")
def off_by_one(repo: base.SourceRepo) -> list[base.Candidate]:
    """Moves an index, bound or counted literal by one."""
    return _bug_candidates(repo, "off_by_one", _off_by_one_mutations)


# ---- drop_condition ----


def _drop_condition_mutations(text: str, site: base.FunctionSite) -> Iterator[Mutation]:
    lines = base.lines_of(text)
    for node in _walk_body(site):
        if isinstance(node, ast.BoolOp):
            joiner = " and " if isinstance(node.op, ast.And) else " or "
            for j in range(len(node.values)):
                rest = [v for k, v in enumerate(node.values) if k != j]
                parts = [base.segment(text, v) for v in rest]
                new = joiner.join(parts)
                if len(rest) == 1 and not isinstance(rest[0], (*_ATOMIC, ast.Compare)):
                    new = f"({new})"
                edit = base.SourceEdit(text).replace_node(node, new)
                yield f"line {node.lineno}: dropped operand {j} of {joiner.strip()}", edit
        elif isinstance(node, ast.If) and not node.orelse:
            header = lines[node.lineno - 1]
            if not header.lstrip().startswith("if ") or node.test.end_lineno != node.lineno:
                continue
            if node.body[0].lineno == node.lineno or base.contains_multiline_string(node):
                continue
            body_lines = lines[node.body[0].lineno - 1 : node.end_lineno]
            shift = len(base.indent_of(lines[node.body[0].lineno - 1])) - len(
                base.indent_of(header)
            )
            dedented = [line[shift:] if line[:shift].isspace() else line for line in body_lines]
            edit = base.SourceEdit(text).replace_lines(node.lineno, node.end_lineno, dedented)
            yield f"line {node.lineno}: removed guard `{header.strip()}`", edit


@base.register("drop_condition", "bug")
def drop_condition(repo: base.SourceRepo) -> list[base.Candidate]:
    """Drops one operand of ``and``/``or``, or the guard of an ``if`` without ``else``."""
    return _bug_candidates(repo, "drop_condition", _drop_condition_mutations)


# ---- swap_arguments ----


def _swap_mutations(text: str, site: base.FunctionSite) -> Iterator[Mutation]:
    for node in _walk_body(site):
        pairs = []
        if isinstance(node, ast.Call) and not any(isinstance(a, ast.Starred) for a in node.args):
            pairs = [(node.args[i], node.args[i + 1], False) for i in range(len(node.args) - 1)]
        elif isinstance(node, ast.BinOp) and isinstance(node.op, _NON_COMMUTATIVE):
            pairs = [(node.left, node.right, True)]
        for left, right, wrap in pairs:
            a, b = base.segment(text, left), base.segment(text, right)
            if not a or not b or a == b:
                continue
            edit = base.SourceEdit(text)
            edit.replace_node(left, _paren(b, right) if wrap else b)
            edit.replace_node(right, _paren(a, left) if wrap else a)
            yield f"line {node.lineno}: swapped {a!r} and {b!r}", edit


@base.register("swap_arguments", "bug")
def swap_arguments(repo: base.SourceRepo) -> list[base.Candidate]:
    """Swaps two adjacent call arguments or a non-commutative operator's operands."""
    return _bug_candidates(repo, "swap_arguments", _swap_mutations)


# ---- wrong_return ----


def _is_boolean(node: ast.AST) -> bool:
    if isinstance(node, ast.Compare | ast.BoolOp):
        return True
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.Not):
        return True
    if isinstance(node, ast.Constant) and isinstance(node.value, bool):
        return True
    if isinstance(node, ast.Call):
        func = node.func
        if isinstance(func, ast.Name) and func.id in _BOOL_CALLS:
            return True
        if isinstance(func, ast.Attribute) and re.match(r"(is|starts|ends|has)", func.attr):
            return True
    return False


def _wrong_return_mutations(text: str, site: base.FunctionSite) -> Iterator[Mutation]:
    args = site.node.args
    params = [a.arg for a in args.posonlyargs + args.args + args.kwonlyargs]
    params = [p for p in params if p not in ("self", "cls")]
    for node in _walk_body(site):
        if not isinstance(node, ast.Return) or node.value is None:
            continue
        value = node.value
        seg = base.segment(text, value)
        if isinstance(value, ast.Constant) and isinstance(value.value, bool):
            new = str(not value.value)
        elif isinstance(value, ast.UnaryOp) and isinstance(value.op, ast.Not):
            new = base.segment(text, value.operand)
            new = new if isinstance(value.operand, _ATOMIC) else f"({new})"
        elif _is_boolean(value):
            new = f"not {_paren(seg, value)}"
        elif isinstance(value, ast.Constant) and value.value is None:
            continue
        else:
            others = [p for p in params if p != seg]
            if not others:
                continue
            new = others[0]
        edit = base.SourceEdit(text).replace_node(value, new)
        yield f"line {node.lineno}: return {seg!r} -> {new!r}", edit


@base.register("wrong_return", "bug")
def wrong_return(repo: base.SourceRepo) -> list[base.Candidate]:
    """Negates a returned boolean, or returns a parameter instead of the result."""
    return _bug_candidates(repo, "wrong_return", _wrong_return_mutations)
