"""The Bazel BUILD file declares every module, test and entry point that exists."""

import os
import re

from cursor_rl.tools import build_file

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_build_file_is_current():
    with open(os.path.join(ROOT, "BUILD"), encoding="utf-8") as fh:
        current = fh.read()
    assert current == build_file.generate(ROOT), (
        "BUILD is stale: run `python -m cursor_rl.tools.build_file --write`"
    )


def test_every_python_file_is_declared():
    with open(os.path.join(ROOT, "BUILD"), encoding="utf-8") as fh:
        text = fh.read()
    declared = set(re.findall(r'srcs = \["([^"]+)"\]', text))
    tests = set(re.findall(r'py_test\(\n    name = "([^"]+)"', text))
    for top in ("cursor_rl", "configs", "launch", "benchmarks", "tests"):
        for dirpath, _, files in os.walk(os.path.join(ROOT, top)):
            if "__pycache__" in dirpath:
                continue
            for name in files:
                if name.endswith(".py"):
                    rel = os.path.relpath(os.path.join(dirpath, name), ROOT)
                    assert rel in declared, f"{rel} is not declared in BUILD"
                    if top == "tests" and name.startswith("test_"):
                        assert rel[:-3] in tests, f"{rel} has no py_test"


def test_first_party_imports_become_deps():
    text = build_file.generate(ROOT)
    block = text.split('name = "cursor_rl/model/moe"')[1].split(")\n")[0]
    assert '":cursor_rl/partitioning"' in block
    assert 'requirement("jax")' in block
