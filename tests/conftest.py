"""Test setup: an emulated 8-device CPU mesh, set before jax is imported anywhere."""

import os

os.environ["XLA_FLAGS"] = (
    os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
).strip()
os.environ["JAX_PLATFORMS"] = "cpu"
# Keep XLA's warnings about tiny test shardings out of the test log.
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

# Before numpy or XLA start threads: glibc malloc set up so XLA reuses its scratch
# memory instead of page-faulting it every call (cursor_rl/host_malloc.py).
from cursor_rl import host_malloc

host_malloc.configure()

import pytest  # noqa: E402


def pytest_collection_modifyitems(config, items):
    try:
        import torch  # noqa: F401
        import transformers  # noqa: F401
    except ImportError:
        skip = pytest.mark.skip(reason="needs the hf extra (torch + transformers)")
        for item in items:
            if "hf" in item.keywords:
                item.add_marker(skip)
