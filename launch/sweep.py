"""Sweeps: the points a config file defines and the ``cursor_rl.main`` flags of each.

A config file may define ``get_sweep()`` next to ``get_config(arg)``, returning a list
of override dicts (``{"optimizer.learning_rate": 1e-3}``); each dict becomes one
work unit with its own workdir. Without ``get_sweep`` the sweep is one point, ``{}``.
Nothing here imports XManager, so the launcher's logic is tested in the main venv.
"""

from __future__ import annotations

import importlib.util
import os
import posixpath
import re
from collections.abc import Mapping, Sequence
from typing import Any

import ml_collections


def split_config_arg(config_arg: str) -> tuple[str, str | None]:
    """``configs/tiny.py:stage=pretrain`` -> (``configs/tiny.py``, ``stage=pretrain``)."""
    path, sep, arg = config_arg.partition(":")
    return path, (arg if sep else None)


def _load_module(path: str):
    spec = importlib.util.spec_from_file_location("_sweep_config", path)
    if spec is None or spec.loader is None:
        raise FileNotFoundError(f"no config file at {path}")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def load_sweep(config_arg: str) -> list[dict[str, Any]]:
    """The sweep points of a config file (``[{}]`` when it defines no ``get_sweep``)."""
    path, _ = split_config_arg(config_arg)
    module = _load_module(path)
    if not hasattr(module, "get_sweep"):
        return [{}]
    points = [dict(point) for point in module.get_sweep()]
    if not points:
        raise ValueError(f"{path}: get_sweep() returned no points")
    return points


def check_overrides(config: ml_collections.ConfigDict, overrides: Mapping[str, Any]) -> None:
    """Raises ValueError naming the first override that is not a field of ``config``."""
    for key in overrides:
        node = config
        for part in key.split("."):
            if not isinstance(node, ml_collections.ConfigDict) or part not in node:
                raise ValueError(f"sweep override {key!r}: the config has no such field")
            node = node[part]


def flag_value(value: Any) -> str:
    """A value as ``--config.x=VALUE`` text that ml_collections parses back to it."""
    if isinstance(value, tuple | list):
        return repr(tuple(value))  # config_flags reads sequences as Python literals
    if isinstance(value, bool):
        return "true" if value else "false"
    return str(value)


def override_flags(overrides: Mapping[str, Any]) -> list[str]:
    return [f"--config.{key}={flag_value(value)}" for key, value in overrides.items()]


def point_name(index: int, point: Mapping[str, Any]) -> str:
    """A short, path-safe name for a sweep point: ``wu1_learning_rate=0.001``."""
    parts = [f"{key.rsplit('.', 1)[-1]}={flag_value(value)}" for key, value in point.items()]
    slug = re.sub(r"[^A-Za-z0-9_.=,+-]+", "-", ",".join(parts)).strip("-")[:80]
    return f"wu{index}" + (f"_{slug}" if slug else "")


def join_workdir(root: str, name: str) -> str:
    """``root/name`` for local paths and ``gs://`` alike (posix separators for URLs)."""
    if "://" in root:
        return posixpath.join(root, name)
    return os.path.join(root, name)


def main_flags(
    config_arg: str,
    workdir: str,
    base_overrides: Mapping[str, Any],
    point: Mapping[str, Any],
) -> list[str]:
    """The flags of ``python -m cursor_rl.main`` for one work unit (point wins over base)."""
    return [
        f"--config={config_arg}",
        f"--workdir={workdir}",
        *override_flags({**base_overrides, **point}),
    ]


def work_units(
    config_arg: str,
    workdir_root: str,
    base_overrides: Mapping[str, Any],
    points: Sequence[Mapping[str, Any]],
) -> list[tuple[str, list[str]]]:
    """(name, main flags) per sweep point, each with its own workdir under ``workdir_root``."""
    units = []
    for index, point in enumerate(points):
        name = point_name(index, point)
        flags = main_flags(config_arg, join_workdir(workdir_root, name), base_overrides, point)
        units.append((name, flags))
    return units
