"""Base models to start a run from, like a model pulled from a hub.

Composer 2 continues pretraining from a strong released base; the tiny recipe does
the same from a base shipped inside the package (``tiny``: see ``tiny/README.md``
for how it was made). A base is an HF checkpoint directory written by the project's
own export (``cursor_rl.tools.convert_hf --to=hf``): ``config.json``,
``model.safetensors`` and ``tokenizer.json``, plus ``SHA256SUMS`` listing the hash of
each file.

``config.init_from`` names the base of a run:

- ``""`` or ``"none"``: no base, the first stage starts from random weights;
- a built-in name (``BUILTIN``), e.g. ``"tiny"``;
- the path of such a directory.

The first stage runs ``verify`` before anything else (tokenizer, data, weights), so
a missing, truncated or altered file, or a base whose shapes do not fit the
configured model, is an error naming the file, never a failure minutes into a run.
"""

from __future__ import annotations

import hashlib
import json
import os
from typing import Any

import jax
import numpy as np
import safetensors

from cursor_rl.model import hf
from cursor_rl.model import transformer as model
from cursor_rl.model.config import ModelConfig

_HERE = os.path.dirname(os.path.abspath(__file__))
BUILTIN = {"tiny": os.path.join(_HERE, "tiny")}
SUMS_FILE = "SHA256SUMS"
REQUIRED = (hf.CONFIG_FILE, hf.SINGLE_FILE, "tokenizer.json")
NONE = ("", "none")


class BaseModelError(ValueError):
    """A base that cannot be used; the message names the file and what is wrong."""


def resolve(spec: str | None) -> str | None:
    """The directory ``spec`` names (module docstring), or None for no base."""
    spec = (spec or "").strip()
    if spec.lower() in NONE:
        return None
    path = BUILTIN.get(spec, os.path.expanduser(spec))
    if not os.path.isdir(path):
        known = ", ".join(sorted(BUILTIN))
        raise BaseModelError(
            f"init_from={spec!r}: {path} is not a directory (built-in bases: {known}; "
            "'none' starts from random weights)"
        )
    return os.path.abspath(path)


def file_sha256(path: str) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def write_sums(path: str) -> None:
    """Writes ``SHA256SUMS`` for the base files in ``path`` (after an export)."""
    lines = [f"{file_sha256(os.path.join(path, name))}  {name}\n" for name in REQUIRED]
    with open(os.path.join(path, SUMS_FILE), "w") as f:
        f.writelines(lines)


def _read_sums(path: str) -> dict[str, str]:
    sums_path = os.path.join(path, SUMS_FILE)
    if not os.path.isfile(sums_path):
        raise BaseModelError(f"{sums_path} is missing: cannot check the base's files")
    sums = {}
    with open(sums_path) as f:
        for number, line in enumerate(f, 1):
            parts = line.split()
            if len(parts) != 2 or len(parts[0]) != 64:
                raise BaseModelError(f"{sums_path}:{number}: expected '<sha256>  <file>'")
            sums[parts[1]] = parts[0]
    return sums


def verify(path: str, model_config: ModelConfig | None = None) -> None:
    """Checks the base at ``path``: every file present and matching ``SHA256SUMS``,
    the tensors readable, and (given ``model_config``) their shapes those of the model.

    Raises:
      BaseModelError: naming the file (or parameter) that is wrong.
    """
    sums = _read_sums(path)
    for name in REQUIRED:
        file = os.path.join(path, name)
        if not os.path.isfile(file):
            raise BaseModelError(f"{file} is missing")
        if name not in sums:
            raise BaseModelError(f"{os.path.join(path, SUMS_FILE)} lists no hash for {name}")
        actual = file_sha256(file)
        if actual != sums[name]:
            raise BaseModelError(
                f"{file}: sha256 {actual[:16]}... does not match {SUMS_FILE} "
                f"({sums[name][:16]}...): the file is truncated or altered"
            )
    try:
        with open(os.path.join(path, hf.CONFIG_FILE)) as f:
            json.load(f)
        with safetensors.safe_open(os.path.join(path, hf.SINGLE_FILE), "np") as f:
            f.keys()
    except (OSError, ValueError, safetensors.SafetensorError) as err:
        raise BaseModelError(f"{path}: {err}") from err
    if model_config is not None:
        check_fits(path, base_config(path, model_config), model_config)


def base_config(path: str, model_config: ModelConfig) -> ModelConfig:
    """The base's model config, with the fields HF configs do not carry from ``model_config``."""
    with open(os.path.join(path, hf.CONFIG_FILE)) as f:
        hf_config = json.load(f)
    try:
        return hf.config_from_hf(hf_config, **_local_fields(model_config))
    except (ValueError, KeyError, TypeError) as err:
        raise BaseModelError(f"{os.path.join(path, hf.CONFIG_FILE)}: {err}") from err


def _local_fields(model_config: ModelConfig) -> dict[str, Any]:
    # Layout and numerics are this run's choice, not the checkpoint's.
    keep = ("param_dtype", "dtype", "scan_layers", "remat_policy", "moe_impl", "attention_impl")
    return {k: getattr(model_config, k) for k in keep}


def check_fits(path: str, base: ModelConfig, model_config: ModelConfig) -> None:
    """Raises BaseModelError naming the first parameter whose shape differs."""
    differs = model.first_shape_difference(base, model_config)
    if differs is not None:
        name, have, want = differs
        raise BaseModelError(
            f"{os.path.join(path, hf.CONFIG_FILE)} does not fit the configured model: "
            f"parameter {name} is {have} in the base and {want} here"
        )


def load_variables(
    path: str, model_config: ModelConfig, *, verified: bool = False
) -> dict[str, Any]:
    """The base's variables as host arrays laid out for ``model_config``.

    The base is verified first, unless the caller already did (``verified``): the
    trainer checks it before anything else and reads it later.
    """
    if not verified:
        verify(path, model_config)
    try:
        _, variables = hf.load_hf_checkpoint(path, **_local_fields(model_config))
    except hf.HFCheckpointError as err:
        raise BaseModelError(f"{path}: {err}") from err
    return jax.tree.map(np.asarray, variables)


def tokenizer_file(path: str) -> str:
    return os.path.join(path, "tokenizer.json")
