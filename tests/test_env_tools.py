"""The agent's tools on a real sandbox: results, errors as observations, confinement."""

import os

import pytest

from cursor_rl.chat.protocol import ToolCall, ToolCallError
from cursor_rl.env import sandbox, testing
from cursor_rl.env.sandbox import Sandbox
from cursor_rl.env.tools import ToolConfig, Tools, truncate


@pytest.fixture(autouse=True, scope="module")
def _needs_sandbox():
    testing.skip_without_sandbox()


@pytest.fixture(scope="module")
def box(tmp_path_factory):
    root = tmp_path_factory.mktemp("tools")
    ws = root / "ws"
    (ws / "pkg").mkdir(parents=True)
    (ws / "pkg" / "mod.py").write_text(
        "import os\n\n\ndef f(x):\n    return x + 1\n\n\ndef g():\n    return y\n"
    )
    (ws / "pkg" / "data.txt").write_text("".join(f"line {i}\n" for i in range(1, 31)))
    (ws / "pkg" / "blob.bin").write_bytes(b"\0\1\2" * 10)
    (ws / ".hidden").mkdir()
    (ws / ".hidden" / "skip.py").write_text("def f(x):\n")
    (root / "secret.txt").write_text("TOP SECRET")
    os.symlink(str(root / "secret.txt"), ws / "escape")
    with Sandbox(str(ws)) as sb:
        os.mkfifo(os.path.join(sb.live_root, "fifo"))
        yield Tools(sb, ToolConfig(max_observation_chars=4000, read_max_lines=10))


def call(tools, name, **arguments):
    return tools.execute(ToolCall(name, arguments))


def test_read_file(box):
    result = call(box, "read_file", path="pkg/data.txt", start_line=3, end_line=4)
    assert result.ok and result.text == "     3\tline 3\n     4\tline 4\n[lines 3-4 of 30]"
    assert call(box, "read_file", path="/workspace/pkg/data.txt").text.endswith(
        "[lines 1-10 of 30]"
    )
    for path, why in [
        ("nope.py", "no such file"),
        ("pkg", "is a directory"),
        ("pkg/blob.bin", "binary"),
        ("fifo", "not a regular file"),
        ("escape", "no such file"),
        ("../secret.txt", "no such file"),
        ("/etc/passwd", "outside the workspace"),
        ("pkg/data.txt/x", "not a directory"),
    ]:
        result = call(box, "read_file", path=path)
        assert not result.ok and why in result.text and "TOP SECRET" not in result.text, path
    result = call(box, "read_file", path="pkg/data.txt", start_line=40)
    assert not result.ok and "has 30 lines" in result.text


def test_edit_file(box):
    result = call(
        box, "edit_file", path="pkg/mod.py", old_str="return x + 1", new_str="return x + 2"
    )
    assert result.ok and "return x + 2" in result.text
    assert "x + 2" in box.sandbox.run("cat pkg/mod.py", 10).stdout
    result = call(box, "edit_file", path="pkg/mod.py", old_str="return", new_str="yield")
    assert not result.ok and "occurs 2 times" in result.text
    result = call(box, "edit_file", path="pkg/mod.py", old_str="absent", new_str="x")
    assert not result.ok and "not found" in result.text
    result = call(box, "edit_file", path="new/dir/file.py", old_str="", new_str="A = 1\n")
    assert result.ok and result.text.startswith("Created")
    listing = box.sandbox.run(
        "stat -c '%u %n' new new/dir new/dir/file.py && echo more >> new/dir/file.py", 10
    )
    assert listing.exit_code == 0 and set(listing.stdout.split()[::2]) == {str(box.sandbox.uid)}
    result = call(box, "edit_file", path="new/dir/file.py", old_str="", new_str="again")
    assert not result.ok and "already exists" in result.text
    # The link points outside (to the host's secret.txt): creating through it must fail.
    result = call(box, "edit_file", path="escape", old_str="", new_str="overwrite?")
    assert not result.ok and "File exists" in result.text
    secret = os.path.join(os.path.dirname(box.sandbox.workspace), "secret.txt")
    with open(secret) as f:
        assert f.read() == "TOP SECRET"


@pytest.mark.parametrize("use_ripgrep", [True, False], ids=["ripgrep", "python"])
def test_search(box, use_ripgrep):
    if use_ripgrep and sandbox.harness_tool("rg") is None:
        pytest.skip("ripgrep is not installed (launch/install_system_deps.sh installs it)")
    tools = Tools(box.sandbox, ToolConfig(use_ripgrep=use_ripgrep, search_max_matches=3))
    result = call(tools, "search", pattern=r"def \w+\(", glob="*.py")
    assert result.ok and result.text.splitlines()[:2] == [
        "pkg/mod.py:4:def f(x):",
        "pkg/mod.py:8:def g():",
    ]
    assert ".hidden" not in result.text
    assert call(tools, "search", pattern="line 2[0-9]", path="pkg/data.txt").text.endswith(
        "more matches not shown; narrow the pattern or path]"
    )
    assert call(tools, "search", pattern="zzz_nothing").text == "No matches."
    assert not call(tools, "search", pattern="(unclosed").ok


def test_list_dir_lint_terminal_submit(box):
    listing = call(box, "list_dir").text.splitlines()
    assert "pkg/" in listing and any(line.startswith("escape -> /") for line in listing)
    if sandbox.harness_tool("ruff"):
        lint = call(box, "lint", path="pkg/mod.py")
        assert lint.ok and "F401" in lint.text and "F821" in lint.text
    result = call(box, "run_terminal", command="echo out; echo err >&2; exit 4")
    assert not result.ok and result.text == "exit code: 4\nstdout:\nout\nstderr:\nerr"
    result = call(box, "run_terminal", command="sleep 60", timeout_s=0.5)
    assert not result.ok and "timed out" in result.text
    assert call(box, "submit").submitted


def test_errors_never_raise(box):
    error = ToolCallError("Error: invalid tool call: not valid JSON", "{")
    assert box.execute(error).text == error.message
    assert not call(box, "read_file", path="a\0b").ok
    assert not call(box, "run_terminal", command="true", timeout_s=-1).ok
    assert "unknown tool" in box.execute(ToolCall("format_disk", {})).text


def test_truncation_marker():
    text = "a" * 50 + "b" * 50
    cut = truncate(text, 20)
    assert (
        cut.startswith("a" * 10)
        and cut.endswith("b" * 10)
        and "[... 80 characters truncated ...]" in cut
    )
    assert truncate("short", 20) == "short"
