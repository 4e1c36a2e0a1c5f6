"""The train/bench split: disjoint, real stdlib modules with tests, importable cheaply (as is
every task-factory module)."""

import os
import subprocess
import sys
import sysconfig

from cursor_rl.data import splits


def test_stdlib_split_is_disjoint_and_sorted():
    assert not set(splits.BENCH_MODULES) & set(splits.TRAIN_MODULES)
    for modules in (splits.BENCH_MODULES, splits.TRAIN_MODULES):
        assert list(modules) == sorted(set(modules))


def test_every_split_module_has_source_and_tests():
    stdlib = sysconfig.get_paths()["stdlib"]
    for name in splits.BENCH_MODULES + splits.TRAIN_MODULES:
        assert os.path.isfile(os.path.join(stdlib, f"{name}.py")), name
        assert os.path.isfile(os.path.join(stdlib, "test", f"test_{name}.py")), name


def test_tiny_seed_ranges_are_disjoint():
    train, bench = splits.tiny_seeds("train"), splits.tiny_seeds("bench")
    assert train.stop <= bench.start or bench.stop <= train.start
    assert splits.stdlib_modules("bench") == splits.BENCH_MODULES


def test_splits_module_imports_nothing_heavy():
    code = (
        "import sys, cursor_rl.data.splits\n"
        "print(sorted(m for m in sys.modules if m in ('jax', 'numpy', 'flax')))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


def test_no_task_factory_module_imports_jax():
    code = (
        "import pkgutil, sys, cursor_rl.tasks, cursor_rl.tasks.generators\n"
        "for pkg in (cursor_rl.tasks, cursor_rl.tasks.generators):\n"
        "    for info in pkgutil.iter_modules(pkg.__path__, pkg.__name__ + '.'):\n"
        "        __import__(info.name)\n"
        "import cursor_rl.env.harness, cursor_rl.env.tools\n"
        "print(sorted(m for m in sys.modules if m.split('.')[0] in ('jax', 'flax', 'grain')))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"
