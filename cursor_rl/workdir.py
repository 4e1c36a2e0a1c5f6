"""A run's directory: the one place that knows where each file of a run goes.

    wd = Workdir.create("workdirs/tiny")    # the entry point: resolve, create, check writable
    wd = Workdir("~/runs/tiny")             # resolve only (tools that read a finished run)
    wd.checkpoint_dir("sft")                # epath.Path("/home/me/runs/tiny/sft/checkpoints")

Layout (every path below comes from a ``Workdir`` method; nothing else joins them)::

    WORKDIR/
      config.json  metrics.jsonl  tensorboard/  tokenizer/tokenizer.json
      pretrain/checkpoints/<step>/  long_context/checkpoints/<step>/  sft/checkpoints/<step>/
      sft_data/demos.jsonl
      tasks/train/  tasks/bench/
      rl/policy/<version>/  rl/checkpoints/<step>/  rl/rollouts/<index>.json  rl/DONE
      eval/<bench>/results.jsonl  eval/registry.records/<record>.json
      ops/heartbeats/<role>.json  ops/events.jsonl  ops/quarantine/
      report.md  *.png

Choices:

1. **Resolved once.** A local workdir is made absolute (``~`` expanded, relative to the
   current directory) when the ``Workdir`` is made, so every path handed to Orbax
   (which refuses relative checkpoint paths) or to a subprocess means the same file.
   ``Workdir.of`` passes a ``Workdir`` through unchanged, so libraries accept either.
2. **Local or ``gs://``**, through ``etils.epath`` (what Orbax uses too): paths are
   ``epath.Path`` objects; ``gs://`` goes through fsspec (the ``gcs`` extra installs
   gcsfs). Other URL schemes are refused up front.
3. **Local copies of what must be on local disk.** Sandboxes bind-mount task datasets
   and the data pipeline reads SFT demonstrations with plain file I/O, so those live
   in ``local_path(...)``: the workdir itself when it is local; for a remote workdir
   a cache directory (``$CURSOR_RL_LOCAL_CACHE``, default ``~/.cache/cursor_rl``),
   mirrored to the workdir with ``publish`` and back with ``fetch`` (a restarted job
   on another machine gets the same tasks).
4. **Checked before anything runs.** ``Workdir.create`` makes the directory and
   writes and deletes a probe file; a path that cannot hold the run raises
   ``WorkdirError`` naming the path and the reason, before any stage starts.
5. **Object stores cannot append or rename atomically**: ``append_text`` and
   ``write_text_atomic`` do the right thing for each kind of path.

Pure Python (no JAX): ``tasks`` and ``env`` use it too.
"""

from __future__ import annotations

import os
import re
import shutil
import socket
import tempfile
import uuid
from collections.abc import Sequence

from etils import epath

# Schemes a workdir may use: what both epath (via fsspec) and Orbax (via TensorStore)
# support and what this project is tested with (a stand-in GCS in tests).
REMOTE_SCHEMES = ("gs",)
LOCAL_CACHE_ENV = "CURSOR_RL_LOCAL_CACHE"
_SCHEME = re.compile(r"^([A-Za-z][A-Za-z0-9+.-]*)://")
_NAME = re.compile(r"^[A-Za-z0-9_.-]+$")


class WorkdirError(ValueError):
    """A workdir that cannot be used (bad form, not creatable, not writable)."""


def scheme_of(path: str | os.PathLike) -> str | None:
    """The URL scheme of ``path`` (``"gs"``), or None for a local path."""
    match = _SCHEME.match(os.fspath(path))
    return match.group(1).lower() if match else None


def is_remote(path: str | os.PathLike) -> bool:
    """Whether ``path`` is on an object store (no appends, no atomic renames)."""
    return scheme_of(path) is not None


def resolve(path: str | os.PathLike, what: str = "workdir") -> epath.Path:
    """``path`` as an absolute local path (``~`` expanded) or a supported URL.

    Args:
      path: the path as given.
      what: what it is, for error messages (``workdir``, ``checkpoint``).

    Raises:
      WorkdirError: empty, or a URL scheme other than ``REMOTE_SCHEMES``.
    """
    text = os.fspath(path)
    if not text or not text.strip():
        raise WorkdirError(f"the {what} path is empty: give a directory or a gs:// URL")
    scheme = scheme_of(text)
    if scheme is None:
        return epath.Path(os.path.abspath(os.path.expanduser(text)))
    if scheme not in REMOTE_SCHEMES:
        supported = ", ".join(f"{s}://" for s in REMOTE_SCHEMES)
        raise WorkdirError(
            f"{what} {text}: the scheme {scheme}:// is not supported "
            f"(a local directory or {supported})"
        )
    if not text[len(scheme) + 3 :].strip("/"):
        raise WorkdirError(f"{what} {text}: names no bucket")
    return epath.Path(text)


def _component(name: str, what: str) -> str:
    if not _NAME.match(name) or name in (".", ".."):
        raise ValueError(f"{what} {name!r} is not a plain directory name")
    return name


class Workdir:
    """The layout of one run's directory (see the module docstring).

    Args:
      path: a local directory (relative, absolute or ``~``) or a ``gs://`` URL.
    """

    def __init__(self, path: str | os.PathLike):
        self.root = resolve(path)
        self.is_remote = is_remote(self.root)

    @classmethod
    def of(cls, workdir: Workdir | str | os.PathLike) -> Workdir:
        """``workdir`` itself if it is a ``Workdir``, else one made from the path."""
        return workdir if isinstance(workdir, Workdir) else cls(workdir)

    @classmethod
    def create(cls, path: str | os.PathLike) -> Workdir:
        """Resolves ``path``, creates the directory and checks it is writable.

        Raises:
          WorkdirError: naming the path and why it cannot hold a run.
        """
        workdir = cls(path)
        workdir.check_writable()
        return workdir

    def check_writable(self) -> None:
        """Creates the workdir (and its local cache) and writes, reads, deletes a probe."""
        places = [self.root]
        if self.is_remote:
            places.append(epath.Path(self.local_root))
        for place in places:
            _probe(place)

    def __fspath__(self) -> str:
        return os.fspath(self.root)

    def __str__(self) -> str:
        return os.fspath(self.root)

    def __repr__(self) -> str:
        return f"Workdir({os.fspath(self.root)!r})"

    def __eq__(self, other) -> bool:
        return isinstance(other, Workdir) and self.root == other.root

    def __hash__(self) -> int:
        return hash(self.root)

    # ---- the run's files ----------------------------------------------------------

    @property
    def config_file(self) -> epath.Path:
        return self.root / "config.json"

    @property
    def metrics_file(self) -> epath.Path:
        return self.root / "metrics.jsonl"

    @property
    def tensorboard_dir(self) -> epath.Path:
        return self.root / "tensorboard"

    @property
    def tokenizer_dir(self) -> epath.Path:
        return self.root / "tokenizer"

    @property
    def tokenizer_file(self) -> epath.Path:
        return self.tokenizer_dir / "tokenizer.json"

    def stage_dir(self, stage: str) -> epath.Path:
        return self.root / _component(stage, "stage")

    def checkpoint_dir(self, stage: str) -> epath.Path:
        """``<stage>/checkpoints``: the train state of a stage (``rl`` too: the trainer's)."""
        return self.stage_dir(stage) / "checkpoints"

    @property
    def sft_demos_file(self) -> epath.Path:
        """The run's generated SFT demonstrations (``sft_data``)."""
        return self.root / "sft_data" / "demos.jsonl"

    def tasks_dir(self, split: str) -> epath.Path:
        """A task dataset the run built (``train`` or ``bench``)."""
        return self.root / "tasks" / _component(split, "split")

    @property
    def policy_dir(self) -> epath.Path:
        """Published RL policies, one checkpoint per version."""
        return self.root / "rl" / "policy"

    @property
    def rollouts_dir(self) -> epath.Path:
        return self.root / "rl" / "rollouts"

    @property
    def rl_done_file(self) -> epath.Path:
        """Written by the RL trainer when it has taken every step."""
        return self.root / "rl" / "DONE"

    @property
    def eval_dir(self) -> epath.Path:
        """Held-out results, one folder per benchmark."""
        return self.root / "eval"

    @property
    def registry_file(self) -> epath.Path:
        """The benchmark saturation registry."""
        return self.eval_dir / "registry.json"

    @property
    def report_file(self) -> epath.Path:
        return self.root / "report.md"

    def plot_file(self, name: str) -> epath.Path:
        return self.root / _component(name, "plot")

    @property
    def ops_dir(self) -> epath.Path:
        """What the run says about its own health (``cursor_rl.ops``)."""
        return self.root / "ops"

    def heartbeat_file(self, role: str) -> epath.Path:
        """The latest heartbeat of one process role (``main``, ``trainer``, ``sampler``)."""
        return self.ops_dir / "heartbeats" / f"{_component(role, 'role')}.json"

    @property
    def ops_events_file(self) -> epath.Path:
        """Events: what the roles report (a failed checkpoint write) and what the
        watchdog detected, did and alerted."""
        return self.ops_dir / "events.jsonl"

    @property
    def quarantine_dir(self) -> epath.Path:
        """Checkpoints, policies and rollouts set aside by a rewind (never deleted)."""
        return self.ops_dir / "quarantine"

    # ---- local copies -------------------------------------------------------------

    @property
    def local_root(self) -> str:
        """Where this machine keeps the run's files that must be on local disk."""
        if not self.is_remote:
            return os.fspath(self.root)
        cache = os.environ.get(LOCAL_CACHE_ENV) or os.path.join("~", ".cache", "cursor_rl")
        scheme = scheme_of(self.root)
        rest = os.fspath(self.root)[len(scheme) + 3 :].strip("/")
        return os.path.join(os.path.abspath(os.path.expanduser(cache)), "runs", scheme, rest)

    def local_path(self, path: epath.Path) -> str:
        """The local counterpart of ``path`` (a path under the workdir)."""
        return os.path.join(self.local_root, self._relative(path))

    def publish(self, path: epath.Path, *, last: Sequence[str] = ()) -> None:
        """Copies the local counterpart of ``path`` (file or directory) to the workdir.

        ``last`` names top-level files copied after everything else (a marker that
        says the copy is complete). Nothing to do for a local workdir.
        """
        if self.is_remote:
            copy_tree(epath.Path(self.local_path(path)), path, last=last)

    def fetch(self, path: epath.Path, *, last: Sequence[str] = ()) -> bool:
        """Makes the local counterpart of ``path`` from the workdir's copy if it is missing.

        Returns whether the local copy exists afterwards.
        """
        local = self.local_path(path)
        if self.is_remote and not os.path.exists(local) and path.exists():
            partial = f"{local}.partial-{uuid.uuid4().hex[:8]}"
            copy_tree(path, epath.Path(partial), last=last)
            os.makedirs(os.path.dirname(local), exist_ok=True)
            os.replace(partial, local)  # a local rename: never half a copy
        return os.path.exists(local)

    def _relative(self, path: epath.Path) -> str:
        root, text = os.fspath(self.root).rstrip("/"), os.fspath(path)
        if text != root and not text.startswith(root + "/"):
            raise ValueError(f"{text} is not under the workdir {root}")
        return text[len(root) + 1 :]


# ---- writing files on any kind of path -------------------------------------------------


def write_text_atomic(path: epath.Path, text: str) -> None:
    """Writes ``path`` so a reader sees the old or the new text, never half of one.

    Local: a temporary file in the same folder, flushed to disk, then renamed over
    ``path``. Object store: one upload (objects are replaced whole).
    """
    path = epath.Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    if is_remote(path):
        path.write_text(text, encoding="utf-8")
        return
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=os.fspath(path.parent))
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as fh:
            fh.write(text)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, os.fspath(path))
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


def append_text(path: epath.Path, text: str) -> None:
    """Appends ``text`` to ``path`` (object stores cannot append: rewritten whole)."""
    path = epath.Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    if is_remote(path):
        old = path.read_text(encoding="utf-8") if path.exists() else ""
        path.write_text(old + text, encoding="utf-8")
        return
    with path.open("a", encoding="utf-8") as fh:
        fh.write(text)


def copy_tree(src: epath.Path, dst: epath.Path, *, last: Sequence[str] = ()) -> None:
    """Copies a file or a directory tree between any two epath locations.

    Files named in ``last`` (directly under ``src``) are copied after the rest.
    """
    src, dst = epath.Path(src), epath.Path(dst)
    if not src.is_dir():
        dst.parent.mkdir(parents=True, exist_ok=True)
        _copy_file(src, dst)
        return
    if not is_remote(src) and not is_remote(dst):
        shutil.copytree(src, dst, dirs_exist_ok=True, symlinks=True)
        return
    deferred = []
    for child in sorted(src.iterdir()):
        if child.name in last:
            deferred.append(child)
        elif child.is_dir():
            copy_tree(child, dst / child.name)
        else:
            dst.mkdir(parents=True, exist_ok=True)
            _copy_file(child, dst / child.name)
    dst.mkdir(parents=True, exist_ok=True)
    for child in deferred:
        _copy_file(child, dst / child.name)


def _copy_file(src: epath.Path, dst: epath.Path) -> None:
    if not is_remote(src) and not is_remote(dst) and os.path.islink(src):
        os.symlink(os.readlink(src), dst)
        return
    dst.write_bytes(src.read_bytes())


def _probe(place: epath.Path) -> None:
    """Creates ``place`` and writes, reads back and deletes a small file in it."""
    where = os.fspath(place)
    try:
        if place.exists() and not place.is_dir():
            raise WorkdirError(f"workdir {where} is not usable: it is a file, not a directory")
        place.mkdir(parents=True, exist_ok=True)
        probe = place / f".write-probe-{socket.gethostname()}-{os.getpid()}"
        probe.write_text("cursor_rl", encoding="utf-8")
        if probe.read_text(encoding="utf-8") != "cursor_rl":
            raise WorkdirError(f"workdir {where} is not usable: a probe file reads back wrong")
        probe.unlink()
    except WorkdirError:
        raise
    except Exception as e:  # OSError locally; gcsfs and fsspec raise their own types
        reason = e.strerror if isinstance(e, OSError) and e.strerror else str(e) or type(e).__name__
        raise WorkdirError(f"workdir {where} is not usable: {reason}") from e
