"""The agent's tools: read, edit, search, list, lint, run commands, submit.

Every tool returns a text observation; nothing a model can write ends an episode
with an exception. Paths are relative to the workspace (``/workspace`` inside the
sandbox; absolute paths under it are accepted too).

Design choices:

1. **Errors are observations.** A missing file, a non-unique ``old_str``, an invalid
   regex, a timeout or a non-zero exit is reported as text (``ToolResult.ok`` False)
   the model can read and recover from. Only ``SandboxError`` (the infrastructure
   failed) propagates; any other unexpected exception becomes an observation too,
   and is logged.
2. **File tools run in the harness, confined by the kernel.** ``read_file``,
   ``edit_file``, ``list_dir`` and the pure-Python ``search`` resolve paths with
   ``openat2(RESOLVE_IN_ROOT)`` on the sandbox's live workspace, so symlinks and
   ``..`` behave as inside the sandbox and can never reach out of it; they cost
   microseconds instead of a sandboxed process. No agent process runs meanwhile (a
   command's processes die with it), so nothing can race them. Files they create
   belong to the sandbox's uid.
3. **Programs run in the sandbox.** ``run_terminal``, ``lint`` (ruff, else pyflakes)
   and ripgrep-backed ``search`` execute as sandboxed commands.
4. **Observations are bounded** (``ToolConfig.max_observation_chars``): head and tail
   are kept around a visible ``[... N characters truncated ...]`` marker.
5. **Search sees the same files either way:** hidden entries (``.git``, ``.venv``)
   are skipped and ignore files are not consulted, by ripgrep (``--no-ignore``) and
   by the Python fallback alike; a glob without ``/`` matches file names, one with
   ``/`` the path.
"""

from __future__ import annotations

import dataclasses
import fnmatch
import logging
import os
import posixpath
import re
import shlex
import stat

from cursor_rl.chat.protocol import ToolCall, ToolCallError, ToolParam, ToolSpec
from cursor_rl.env import fs
from cursor_rl.env.sandbox import WORKDIR, Sandbox, SandboxError, harness_tool

_log = logging.getLogger(__name__)

TOOL_SPECS: tuple[ToolSpec, ...] = (
    ToolSpec(
        "read_file",
        "Read a text file of the workspace, with line numbers.",
        (
            ToolParam("path", "string", "File path, relative to the workspace."),
            ToolParam("start_line", "integer", "First line to show (1-based).", required=False),
            ToolParam("end_line", "integer", "Last line to show (inclusive).", required=False),
        ),
    ),
    ToolSpec(
        "edit_file",
        "Replace the one occurrence of old_str in a file with new_str. With an empty "
        "old_str, create the file (parent directories included) with new_str as content.",
        (
            ToolParam("path", "string", "File path, relative to the workspace."),
            ToolParam("old_str", "string", "Exact text to replace; must occur exactly once."),
            ToolParam("new_str", "string", "Replacement text."),
        ),
    ),
    ToolSpec(
        "search",
        "Search file contents with a regular expression; prints path:line:text.",
        (
            ToolParam("pattern", "string", "Regular expression."),
            ToolParam("glob", "string", "Only files matching this glob, e.g. *.py.", False),
            ToolParam("path", "string", "Directory or file to search (default: all).", False),
        ),
    ),
    ToolSpec(
        "list_dir",
        "List a directory of the workspace (directories end with /).",
        (ToolParam("path", "string", "Directory (default: the workspace root).", False),),
    ),
    ToolSpec(
        "lint",
        "Report lint errors (undefined names, unused imports, syntax errors) in a Python "
        "file or directory.",
        (ToolParam("path", "string", "File or directory (default: the workspace).", False),),
    ),
    ToolSpec(
        "run_terminal",
        "Run a shell command in the workspace and show its exit code and output.",
        (
            ToolParam("command", "string", "A /bin/sh command line."),
            ToolParam("timeout_s", "number", "Time limit in seconds.", required=False),
        ),
    ),
    ToolSpec("submit", "Finish the task: the workspace as it is now is graded."),
)


@dataclasses.dataclass(frozen=True)
class ToolConfig:
    """Limits of the tools (observation sizes, timeouts).

    Attributes:
      max_observation_chars: longest observation; longer ones keep head and tail.
      read_max_lines: lines ``read_file`` shows when no end line is given.
      max_file_bytes: largest file ``read_file``/``edit_file`` handle.
      default_timeout_s: ``run_terminal`` timeout when the model gives none.
      max_timeout_s: cap on the model's ``timeout_s``.
      search_max_matches: matching lines shown by ``search``.
      search_timeout_s: time limit of a ripgrep search.
      list_max_entries: entries shown by ``list_dir``.
      lint_timeout_s: time limit of a lint run.
      use_ripgrep: None uses ripgrep when the harness has it; False forces Python.
    """

    max_observation_chars: int = 20_000
    read_max_lines: int = 1000
    max_file_bytes: int = 4 << 20
    default_timeout_s: float = 60.0
    max_timeout_s: float = 600.0
    search_max_matches: int = 200
    search_timeout_s: float = 30.0
    list_max_entries: int = 500
    lint_timeout_s: float = 60.0
    use_ripgrep: bool | None = None


@dataclasses.dataclass(frozen=True)
class ToolResult:
    """An observation: its text, whether the tool succeeded, whether it was ``submit``."""

    text: str
    ok: bool = True
    submitted: bool = False


class _ToolError(Exception):
    """A failure the model should read about (choice 1)."""


class _Missing(_ToolError):
    """The path does not exist."""


def truncate(text: str, limit: int) -> str:
    """Keeps the head and tail of ``text`` around a marker saying how much was cut."""
    if len(text) <= limit:
        return text
    head = limit // 2
    tail = limit - head
    cut = len(text) - head - tail
    return f"{text[:head]}\n[... {cut} characters truncated ...]\n{text[-tail:]}"


def _number_lines(lines: list[str], first: int) -> str:
    return "\n".join(f"{first + i:6d}\t{line}" for i, line in enumerate(lines))


class Tools:
    """The tools of one episode, acting on one entered ``Sandbox``.

    Args:
      sandbox: the episode's sandbox (entered).
      config: limits.
    """

    def __init__(self, sandbox: Sandbox, config: ToolConfig | None = None):
        self.sandbox = sandbox
        self.config = config or ToolConfig()
        self.specs = {spec.name: spec for spec in TOOL_SPECS}
        self._handlers = {
            "read_file": self._read_file,
            "edit_file": self._edit_file,
            "search": self._search,
            "list_dir": self._list_dir,
            "lint": self._lint,
            "run_terminal": self._run_terminal,
            "submit": self._submit,
        }

    def execute(self, call: ToolCall | ToolCallError) -> ToolResult:
        """Runs one parsed call and returns its observation (never raises but SandboxError)."""
        if isinstance(call, ToolCallError):
            return ToolResult(call.message, ok=False)
        handler = self._handlers.get(call.name)
        if handler is None:
            return ToolResult(f"Error: unknown tool {call.name!r}", ok=False)
        try:
            result = handler(**call.arguments)
        except _ToolError as e:
            result = ToolResult(f"Error: {e}", ok=False)
        except SandboxError:
            raise
        except Exception as e:  # choice 1: a tool bug must not end the episode
            _log.exception("tool %s failed on %r", call.name, call.arguments)
            result = ToolResult(f"Error: {call.name} failed: {type(e).__name__}: {e}", ok=False)
        text = truncate(result.text, self.config.max_observation_chars)
        return dataclasses.replace(result, text=text)

    # ---- paths ----

    @staticmethod
    def _relative(path: str) -> str:
        path = path.strip()
        if not path:
            raise _ToolError("empty path")
        if path.startswith("/"):
            if path != WORKDIR and not path.startswith(WORKDIR + "/"):
                raise _ToolError(f"{path} is outside the workspace ({WORKDIR})")
            path = path[len(WORKDIR) :].lstrip("/") or "."
        return path

    def _open(self, path: str, flags: int, mode: int = 0) -> int:
        root = os.open(self.sandbox.live_root, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        try:
            return fs.open_in_root(root, self._relative(path), flags, mode)
        except FileNotFoundError:
            raise _Missing(f"{path}: no such file or directory") from None
        except NotADirectoryError:
            raise _ToolError(f"{path}: a component of the path is not a directory") from None
        except OSError as e:
            raise _ToolError(f"{path}: {e.strerror}") from None
        finally:
            os.close(root)

    def _read_text(self, path: str) -> str:
        fd = self._open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_NOCTTY)
        try:
            st = os.fstat(fd)
            if stat.S_ISDIR(st.st_mode):
                raise _ToolError(f"{path} is a directory (use list_dir)")
            if not stat.S_ISREG(st.st_mode):
                raise _ToolError(f"{path} is not a regular file")
            if st.st_size > self.config.max_file_bytes:
                raise _ToolError(
                    f"{path} has {st.st_size} bytes, more than the {self.config.max_file_bytes} "
                    "this tool reads; use run_terminal (head, sed -n) for parts of it"
                )
            data = os.read(fd, self.config.max_file_bytes + 1)
        finally:
            os.close(fd)
        if b"\0" in data[:8192]:
            raise _ToolError(f"{path} is a binary file ({len(data)} bytes)")
        try:
            return data.decode("utf-8")
        except UnicodeDecodeError:
            raise _ToolError(f"{path} is not UTF-8 text") from None

    def _write_text(self, path: str, text: str, create: bool):
        data = text.encode("utf-8")
        if create:
            parent, name = posixpath.split(posixpath.normpath("/" + self._relative(path)))
            if not name:
                raise _ToolError(f"{path} is not a file path")
            root = os.open(self.sandbox.live_root, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
            try:
                try:
                    dir_fd = fs.make_dirs_in_root(root, parent, owner=self.sandbox.owner)
                except OSError as e:
                    raise _ToolError(
                        f"cannot create the directories of {path}: {e.strerror}"
                    ) from e
            finally:
                os.close(root)
            try:
                fd = os.open(
                    name, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o644, dir_fd=dir_fd
                )
            except OSError as e:
                raise _ToolError(f"cannot create {path}: {e.strerror}") from e
            finally:
                os.close(dir_fd)
            os.fchown(fd, *self.sandbox.owner)
        else:
            fd = self._open(path, os.O_WRONLY | os.O_TRUNC | os.O_NONBLOCK)
        try:
            view = memoryview(data)
            while view:
                view = view[os.write(fd, view) :]
        except OSError as e:  # the workspace quota (ENOSPC) or file size limit
            raise _ToolError(f"writing {path} failed: {e.strerror}") from e
        finally:
            os.close(fd)

    # ---- tools ----

    def _read_file(self, path: str, start_line: int | None = None, end_line: int | None = None):
        lines = self._read_text(path).splitlines()
        if not lines:
            return ToolResult(f"{path} is empty.")
        first = 1 if start_line is None else start_line
        last = end_line if end_line is not None else first + self.config.read_max_lines - 1
        last = min(last, len(lines))
        if first < 1 or first > len(lines) or last < first:
            raise _ToolError(f"invalid line range {first}-{last}: {path} has {len(lines)} lines")
        text = _number_lines(lines[first - 1 : last], first)
        if first > 1 or last < len(lines):
            text += f"\n[lines {first}-{last} of {len(lines)}]"
        return ToolResult(text)

    def _edit_file(self, path: str, old_str: str, new_str: str):
        if old_str == "":
            try:
                existing = self._read_text(path)
            except _Missing:
                self._write_text(path, new_str, create=True)
                return ToolResult(f"Created {path} ({len(new_str.splitlines())} lines).")
            if existing:
                raise _ToolError(f"{path} already exists; give old_str to replace part of it")
            self._write_text(path, new_str, create=False)
            return ToolResult(f"Wrote {path} ({len(new_str.splitlines())} lines).")
        content = self._read_text(path)
        count = content.count(old_str)
        if count == 0:
            raise _ToolError(
                f"old_str was not found in {path} (it must match exactly, whitespace included)"
            )
        if count > 1:
            raise _ToolError(
                f"old_str occurs {count} times in {path}; include more context to make it unique"
            )
        start = content.index(old_str)
        updated = content[:start] + new_str + content[start + len(old_str) :]
        self._write_text(path, updated, create=False)
        first = content[:start].count("\n") + 1
        lines = updated.splitlines()
        shown_from = max(first - 3, 1)
        shown_to = min(first + new_str.count("\n") + 3, len(lines))
        snippet = _number_lines(lines[shown_from - 1 : shown_to], shown_from)
        return ToolResult(f"Edited {path}. Lines {shown_from}-{shown_to} now read:\n{snippet}")

    def _search(self, pattern: str, glob: str | None = None, path: str = "."):
        use_rg = self.config.use_ripgrep
        rg = harness_tool("rg")
        if use_rg is None:
            use_rg = rg is not None
        if use_rg and rg is None:
            raise _ToolError("ripgrep is not available")
        relative = self._relative(path)
        lines = (
            self._search_rg(rg, pattern, glob, relative)
            if use_rg
            else self._search_py(pattern, glob, relative)
        )
        limit = self.config.search_max_matches
        if not lines:
            return ToolResult("No matches.")
        text = "\n".join(lines[:limit])
        if len(lines) > limit:
            text += f"\n[{len(lines) - limit} more matches not shown; narrow the pattern or path]"
        return ToolResult(text)

    def _search_rg(self, rg: str, pattern: str, glob: str | None, path: str) -> list[str]:
        cmd = [
            rg,
            "--line-number",
            "--no-heading",
            "--color=never",
            "--no-ignore",
            "--max-columns=300",
        ]
        cmd += ["--max-count", str(self.config.search_max_matches + 1)]
        if glob:
            cmd += ["--glob", glob]
        cmd += ["-e", pattern]
        if path != ".":  # ripgrep then prints paths without a ./ prefix
            cmd += ["--", path]
        result = self.sandbox.run(shlex.join(cmd), timeout_s=self.config.search_timeout_s)
        if result.timed_out:
            raise _ToolError("search timed out; narrow the path or glob")
        if result.exit_code == 2 and not result.stdout:
            raise _ToolError(result.stderr.strip() or "search failed")
        return result.stdout.splitlines()[: self.config.search_max_matches + 1]

    def _search_py(self, pattern: str, glob: str | None, path: str) -> list[str]:
        try:
            regex = re.compile(pattern)
        except re.error as e:
            raise _ToolError(f"invalid regular expression: {e}") from None
        root = os.open(self.sandbox.live_root, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        found: list[str] = []
        try:
            files = fs.iter_files(
                root,
                path,
                exclude=lambda name: name.startswith("."),
                max_bytes=self.config.max_file_bytes,
            )
            for rel, data in files:
                if glob and not fnmatch.fnmatchcase(
                    rel if "/" in glob else posixpath.basename(rel), glob
                ):
                    continue
                if b"\0" in data[:8192]:
                    continue
                for number, line in enumerate(data.decode("utf-8", "replace").splitlines(), 1):
                    if regex.search(line):
                        found.append(f"{rel}:{number}:{line[:300]}")
                        if len(found) > self.config.search_max_matches:
                            return found
        except FileNotFoundError:
            raise _ToolError(f"{path}: no such file or directory") from None
        finally:
            os.close(root)
        return found

    def _list_dir(self, path: str = "."):
        fd = self._open(path, os.O_RDONLY | os.O_DIRECTORY)
        try:
            entries = []
            with os.scandir(fd) as it:
                for entry in it:
                    if entry.is_symlink():
                        entries.append(f"{entry.name} -> {os.readlink(entry.name, dir_fd=fd)}")
                    elif entry.is_dir(follow_symlinks=False):
                        entries.append(entry.name + "/")
                    else:
                        entries.append(entry.name)
        finally:
            os.close(fd)
        entries.sort()
        if not entries:
            return ToolResult(f"{path} is empty.")
        limit = self.config.list_max_entries
        text = "\n".join(entries[:limit])
        if len(entries) > limit:
            text += f"\n[{len(entries) - limit} more entries not shown]"
        return ToolResult(text)

    def _lint(self, path: str = "."):
        target = shlex.quote(self._relative(path))
        ruff = harness_tool("ruff")
        if ruff:
            cmd = f"{ruff} check --isolated --no-cache --output-format=concise -- {target}"
        else:
            cmd = f"python3 -m pyflakes {target}"
        result = self.sandbox.run(cmd, timeout_s=self.config.lint_timeout_s)
        output = (result.stdout + result.stderr).strip()
        if result.timed_out:
            raise _ToolError("lint timed out")
        if not ruff and "No module named pyflakes" in output:
            raise _ToolError("no linter (ruff or pyflakes) is available in this sandbox")
        if result.exit_code == 0:
            return ToolResult("No lint problems found.")
        if (ruff and result.exit_code != 1) or not output:
            raise _ToolError(output or f"the linter exited with {result.exit_code}")
        return ToolResult(output)

    def _run_terminal(self, command: str, timeout_s: float | None = None):
        if timeout_s is None:
            timeout_s = self.config.default_timeout_s
        if not timeout_s > 0:
            raise _ToolError("timeout_s must be positive")
        timeout_s = min(timeout_s, self.config.max_timeout_s)
        result = self.sandbox.run(command, timeout_s=timeout_s)
        parts = [f"exit code: {result.exit_code}"]
        if result.stdout:
            parts.append("stdout:\n" + result.stdout.rstrip("\n"))
        if result.stderr:
            parts.append("stderr:\n" + result.stderr.rstrip("\n"))
        ok = result.exit_code == 0 and not result.timed_out
        return ToolResult("\n".join(parts), ok=ok)

    def _submit(self):
        return ToolResult("Submitted.", submitted=True)
