"""Feature removal: take working code away so that tests fail, and ask for it back.

Three granularities, each a registered generator:

* ``remove_function_body``: a function's or method's body becomes
  ``raise NotImplementedError`` (signature and docstring stay, so the task is
  specified by them and by the callers);
* ``remove_class``: a whole module-level class is deleted;
* ``remove_module``: a whole file is deleted (only in repositories with several
  code files, otherwise nothing else could pass).

Choices: comments inside the removed code go with it (they would describe the
solution); sizes are bounded (``MAX_BODY_LINES``, ``MAX_CLASS_LINES``,
``MAX_MODULE_LINES``) so a task stays a feature, not a rewrite of a library; bodies
that are already stubs (``pass``, ``...``, ``raise NotImplementedError``) are
skipped, since removing them changes nothing.
"""

from __future__ import annotations

import ast
import functools
import re

from cursor_rl.tasks import prompts
from cursor_rl.tasks.generators import base

MAX_BODY_LINES = 60
MAX_CLASS_LINES = 150
MAX_MODULE_LINES = 300


def _is_stub(body: list[ast.stmt]) -> bool:
    if len(body) != 1:
        return False
    stmt = body[0]
    if isinstance(stmt, ast.Pass):
        return True
    if isinstance(stmt, ast.Expr) and isinstance(stmt.value, ast.Constant):
        return True  # `...` or a stray string
    if isinstance(stmt, ast.Raise) and stmt.exc is not None:
        exc = stmt.exc.func if isinstance(stmt.exc, ast.Call) else stmt.exc
        return isinstance(exc, ast.Name) and exc.id == "NotImplementedError"
    return False


def _header_end(lines: list[str], site: base.FunctionSite) -> int:
    """The line after which the body is cut: the docstring's end, else the header's."""
    if site.docstring is not None:
        return site.node.body[0].end_lineno
    return base.header_end(lines, site.node)


def _nonblank(lines: list[str]) -> int:
    return sum(1 for line in lines if line.strip() and not line.strip().startswith("#"))


@base.register("remove_function_body", "feature")
def remove_function_body(repo: base.SourceRepo) -> list[base.Candidate]:
    """Replaces one function or method body at a time by ``raise NotImplementedError``."""
    candidates = []
    visible = repo.visible_files()
    for target in base.target_files(repo):
        path, text, lines = target.path, target.text, target.lines
        for site in base.function_sites(target.module):
            if not site.body or _is_stub(site.body):
                continue
            if site.body[0].lineno == site.node.lineno:  # one-line def: nothing to cut cleanly
                continue
            first = _header_end(lines, site) + 1
            last = site.node.end_lineno
            if site.body[0].lineno < first:  # statement on the docstring's line
                continue
            removed = lines[first - 1 : last]
            if not 1 <= _nonblank(removed) <= MAX_BODY_LINES:
                continue
            indent = base.indent_of(lines[site.body[0].lineno - 1])
            broken = base.SourceEdit(text).replace_lines(
                first, last, [f"{indent}raise NotImplementedError"]
            )
            call_sites = base.call_site_lines(
                visible, site.name, exclude=(path, *base.line_span(site.node))
            )
            prompt = prompts.feature_prompt(
                kind="method" if site.class_node is not None else "function",
                symbol=site.symbol,
                file=path,
                header=base.signature(text, site.node),
                docstring=site.docstring,
                call_sites=call_sites,
                style=repo.prompt_style,
            )
            candidates.append(
                _candidate(
                    "remove_function_body",
                    path,
                    site.symbol,
                    broken.apply(),
                    prompt,
                    lines_removed=_nonblank(removed),
                    call_sites=base.count_references(visible, site.name),
                    has_docstring=site.docstring is not None,
                )
            )
    return candidates


def _feature_prompt(text: str, failures) -> str:
    del failures  # a feature request does not depend on which tests fail
    return text


def _candidate(
    generator: str,
    path: str,
    symbol: str,
    broken: str | None,
    prompt: str,
    *,
    lines_removed: int,
    call_sites: int,
    has_docstring: bool,
) -> base.Candidate:
    return base.Candidate(
        generator=generator,
        category="feature",
        file=path,
        symbol=symbol,
        start_changes={path: broken},
        prompt=functools.partial(_feature_prompt, prompt),
        features={
            "lines_removed": lines_removed,
            "call_sites": call_sites,
            "has_docstring": int(has_docstring),
        },
        description=f"{generator} {path}:{symbol}",
    )


def _members(text: str, node: ast.ClassDef | ast.Module) -> list[tuple[str, str | None]]:
    """Header and docstring of each function/class directly inside ``node``."""
    members = []
    for item in node.body:
        if isinstance(item, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
            members.append((base.signature(text, item), ast.get_docstring(item)))
    return members


def _class_attributes(node: ast.ClassDef) -> list[str]:
    names = []
    for item in node.body:
        targets = item.targets if isinstance(item, ast.Assign) else []
        if isinstance(item, ast.AnnAssign):
            targets = [item.target]
        names += [t.id for t in targets if isinstance(t, ast.Name)]
    return names


@base.register("remove_class", "feature")
def remove_class(repo: base.SourceRepo) -> list[base.Candidate]:
    """Deletes one module-level class at a time."""
    candidates = []
    visible = repo.visible_files()
    for target in base.target_files(repo):
        path, text, lines = target.path, target.text, target.lines
        for node in target.module.body:
            if not isinstance(node, ast.ClassDef):
                continue
            first, last = base.line_span(node)
            removed = lines[first - 1 : last]
            methods = [n for n in node.body if isinstance(n, ast.FunctionDef)]
            if not methods or _nonblank(removed) > MAX_CLASS_LINES:
                continue
            broken = base.SourceEdit(text).replace_lines(first, last, [])
            members = _members(text, node)
            attributes = _class_attributes(node)
            if attributes:
                members.append((f"class attributes: {', '.join(attributes)}", None))
            prompt = prompts.feature_prompt(
                kind="class",
                symbol=node.name,
                file=path,
                header=base.signature(text, node),
                docstring=ast.get_docstring(node),
                call_sites=base.call_site_lines(visible, node.name, exclude=(path, first, last)),
                style=repo.prompt_style,
                members=members,
            )
            candidates.append(
                _candidate(
                    "remove_class",
                    path,
                    node.name,
                    broken.apply(),
                    prompt,
                    lines_removed=_nonblank(removed),
                    call_sites=base.count_references(visible, node.name),
                    has_docstring=ast.get_docstring(node) is not None,
                )
            )
    return candidates


@base.register("remove_module", "feature")
def remove_module(repo: base.SourceRepo) -> list[base.Candidate]:
    """Deletes one whole code file (repositories with at least two code files)."""
    if len(repo.target_files) < 2:
        return []
    candidates = []
    visible = repo.visible_files()
    for target in base.target_files(repo):
        path, dotted, text, module = target.path, target.dotted, target.text, target.module
        if not 1 <= _nonblank(target.lines) <= MAX_MODULE_LINES:
            continue
        members = _members(text, module)
        if not members:
            continue
        leaf = dotted.rsplit(".", 1)[-1]
        importers = []
        pattern = re.compile(rf"^\s*(from|import)\s.*\b{re.escape(leaf)}\b")
        for other in sorted(visible):
            if other == path or not other.endswith(".py"):
                continue
            for lineno, line in enumerate(base.lines_of(visible[other]), 1):
                if pattern.match(line):
                    importers.append(f"{other}:{lineno}: {line.strip()}")
        prompt = prompts.feature_prompt(
            kind="module",
            symbol=dotted,
            file=path,
            header=f"module {dotted}",
            docstring=ast.get_docstring(module),
            call_sites=importers[:3],
            style=repo.prompt_style,
            members=members,
        )
        candidates.append(
            _candidate(
                "remove_module",
                path,
                dotted,
                None,
                prompt,
                lines_removed=_nonblank(target.lines),
                call_sites=len(importers),
                has_docstring=ast.get_docstring(module) is not None,
            )
        )
    return candidates
