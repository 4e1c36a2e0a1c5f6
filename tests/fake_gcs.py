"""A local stand-in for Google Cloud Storage, for tests of ``gs://`` workdirs (no network).

A ``gs://BUCKET/KEY`` object is the file ``ROOT/BUCKET/KEY``. Two clients reach it:

* ``epath`` (our own files, Orbax's directories and markers) goes through fsspec's
  ``gs``/``gcs`` protocol; ``FakeGcsFileSystem`` takes that protocol over and maps
  paths onto ROOT. Like GCS it cannot append to an object.
* TensorStore (Orbax's arrays) speaks the GCS JSON API over HTTP; ``FakeGcsServer``
  answers the requests it makes (object read, ranged read, upload, delete, list,
  with generation preconditions) on 127.0.0.1, and ``TENSORSTORE_GCS_HTTP_URL``
  points TensorStore at it.
* Orbax asks ``google.cloud.storage`` whether a bucket has a hierarchical namespace
  before listing checkpoint steps. Where that library is not installed, a module
  standing in for it answers for the buckets under ROOT (flat namespace).

``fake_gcs(root)`` installs both for the duration of a ``with`` block.
"""

from __future__ import annotations

import contextlib
import http.server
import json
import os
import sys
import threading
import types
import urllib.parse
from collections.abc import Iterator

import fsspec
from fsspec.implementations.local import LocalFileSystem


class FakeGcsFileSystem(LocalFileSystem):
    """fsspec's ``gs``/``gcs`` protocol served from a local directory (``root``)."""

    protocol = ("gs", "gcs")
    root = ""  # set by fake_gcs(); a class attribute because fsspec caches instances
    # Every instance is the same state (the directory), so fsspec may cache one.
    cachable = True

    @classmethod
    def _strip_protocol(cls, path):
        path = os.fspath(path)
        for prefix in ("gs://", "gcs://"):
            if path.startswith(prefix):
                if not cls.root:
                    raise RuntimeError("the fake GCS filesystem is not installed")
                return os.path.join(cls.root, path[len(prefix) :]).rstrip("/") or "/"
        return super()._strip_protocol(path)

    def unstrip_protocol(self, name: str) -> str:
        return "gs://" + os.path.relpath(name, self.root)

    def glob(self, path, **kwargs):
        # epath prefixes the protocol to what glob returns: give paths relative to root.
        return [os.path.relpath(p, self.root) for p in super().glob(path, **kwargs)]

    def _open(self, path, mode="rb", **kwargs):
        if "a" in mode:
            raise NotImplementedError(f"GCS objects cannot be appended to ({path})")
        return super()._open(path, mode=mode, **kwargs)


class _Handler(http.server.BaseHTTPRequestHandler):
    """The GCS JSON API calls TensorStore's ``gcs`` kvstore driver makes."""

    protocol_version = "HTTP/1.1"
    server: FakeGcsServer

    def log_message(self, format, *args):  # quiet
        pass

    # ---- helpers ------------------------------------------------------------------

    def _file(self, bucket: str, name: str) -> str:
        return os.path.join(self.server.root, bucket, name)

    def _generation(self, path: str) -> int:
        return self.server.generations.get(path, 1)

    def _reply(self, status: int, body: bytes = b"", headers: dict[str, str] | None = None):
        self.send_response(status)
        for key, value in (headers or {}).items():
            self.send_header(key, value)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        if body and self.command != "HEAD":
            self.wfile.write(body)

    def _json(self, status: int, payload) -> None:
        self._reply(status, json.dumps(payload).encode(), {"Content-Type": "application/json"})

    def _metadata(self, bucket: str, name: str, path: str) -> dict:
        return {
            "kind": "storage#object",
            "bucket": bucket,
            "name": name,
            "size": str(os.path.getsize(path)),
            "generation": str(self._generation(path)),
            "metageneration": "1",
        }

    def _precondition_fails(self, query: dict, path: str) -> bool:
        exists = os.path.isfile(path)
        generation = self._generation(path) if exists else 0
        if "ifGenerationMatch" in query and int(query["ifGenerationMatch"][0]) != generation:
            return True
        return (
            "ifGenerationNotMatch" in query
            and int(query["ifGenerationNotMatch"][0]) == generation
            and exists
        )

    def _parse(self) -> tuple[list[str], dict]:
        url = urllib.parse.urlsplit(self.path)
        parts = [urllib.parse.unquote(p) for p in url.path.split("/")[1:]]
        return parts, urllib.parse.parse_qs(url.query)

    # ---- verbs --------------------------------------------------------------------

    def do_GET(self):
        parts, query = self._parse()
        # /storage/v1/b/BUCKET/o            (list)
        # /storage/v1/b/BUCKET/o/OBJECT     (metadata, or the bytes with alt=media)
        if parts[:2] != ["storage", "v1"] or len(parts) < 5 or parts[2] != "b":
            return self._json(400, {"error": f"unexpected GET {self.path}"})
        bucket = parts[3]
        if len(parts) == 5:
            return self._list(bucket, query)
        name = "/".join(parts[5:])
        path = self._file(bucket, name)
        with self.server.lock:
            if not os.path.isfile(path):
                return self._json(404, {"error": {"code": 404, "message": "No such object"}})
            if self._precondition_fails(query, path):
                status = 304 if "ifGenerationNotMatch" in query else 412
                return self._reply(status, b"", {"x-goog-generation": str(self._generation(path))})
            if query.get("alt") != ["media"]:
                return self._json(200, self._metadata(bucket, name, path))
            with open(path, "rb") as fh:
                data = fh.read()
            headers = {
                "x-goog-generation": str(self._generation(path)),
                "x-goog-metageneration": "1",
                "Content-Type": "application/octet-stream",
            }
        status = 200
        ranged = self.headers.get("Range")
        if ranged and ranged.startswith("bytes="):
            first, _, last = ranged[len("bytes=") :].partition("-")
            if first == "":  # a suffix: the last N bytes
                start = max(0, len(data) - int(last))
                end = len(data) - 1
            else:
                start = int(first)
                end = int(last) if last else len(data) - 1
            end = min(end, len(data) - 1)
            headers["Content-Range"] = f"bytes {start}-{end}/{len(data)}"
            data = data[start : end + 1]
            status = 206
        return self._reply(status, data, headers)

    do_HEAD = do_GET

    def _list(self, bucket: str, query: dict) -> None:
        prefix = query.get("prefix", [""])[0]
        start = query.get("startOffset", [""])[0]
        end = query.get("endOffset", [None])[0]
        root = os.path.join(self.server.root, bucket)
        names = []
        for dirpath, _, filenames in os.walk(root):
            for filename in filenames:
                name = os.path.relpath(os.path.join(dirpath, filename), root).replace(os.sep, "/")
                if name.startswith(prefix) and name >= start and (end is None or name < end):
                    names.append(name)
        items = []
        for name in sorted(names):
            path = self._file(bucket, name)
            items.append(self._metadata(bucket, name, path))
        return self._json(200, {"kind": "storage#objects", "items": items})

    def do_POST(self):
        parts, query = self._parse()
        # /upload/storage/v1/b/BUCKET/o?uploadType=media&name=OBJECT
        if parts[:3] != ["upload", "storage", "v1"] or "name" not in query:
            return self._json(400, {"error": f"unexpected POST {self.path}"})
        if query.get("uploadType") != ["media"]:
            return self._json(400, {"error": f"unsupported upload {query.get('uploadType')}"})
        bucket, name = parts[4], query["name"][0]
        length = int(self.headers.get("Content-Length", 0))
        data = self.rfile.read(length)
        path = self._file(bucket, name)
        with self.server.lock:
            if self._precondition_fails(query, path):
                return self._json(412, {"error": {"code": 412, "message": "precondition"}})
            os.makedirs(os.path.dirname(path), exist_ok=True)
            tmp = f"{path}.fake-gcs-upload"
            with open(tmp, "wb") as fh:
                fh.write(data)
            os.replace(tmp, path)
            self.server.generation_counter += 1
            self.server.generations[path] = self.server.generation_counter
            return self._json(200, self._metadata(bucket, name, path))

    def do_DELETE(self):
        parts, query = self._parse()
        if parts[:2] != ["storage", "v1"] or len(parts) < 6:
            return self._json(400, {"error": f"unexpected DELETE {self.path}"})
        bucket, name = parts[3], "/".join(parts[5:])
        path = self._file(bucket, name)
        with self.server.lock:
            if not os.path.isfile(path):
                return self._json(404, {"error": {"code": 404, "message": "No such object"}})
            if self._precondition_fails(query, path):
                return self._json(412, {"error": {"code": 412, "message": "precondition"}})
            os.remove(path)
            self.server.generations.pop(path, None)
        return self._reply(204)


class FakeGcsServer(http.server.ThreadingHTTPServer):
    """The JSON API endpoint over ``root`` on 127.0.0.1 (a free port)."""

    daemon_threads = True

    def __init__(self, root: str):
        super().__init__(("127.0.0.1", 0), _Handler)
        self.root = root
        self.lock = threading.Lock()
        self.generations: dict[str, int] = {}
        self.generation_counter = 1
        self._thread = threading.Thread(target=self.serve_forever, daemon=True)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server_address[1]}"

    def start(self) -> FakeGcsServer:
        self._thread.start()
        return self

    def stop(self) -> None:
        self.shutdown()
        self.server_close()


@contextlib.contextmanager
def fake_gcs(root: str, buckets: tuple[str, ...] = ("bucket",)) -> Iterator[FakeGcsServer]:
    """Routes ``gs://`` (epath/fsspec, TensorStore, the storage client) to ``root``.

    ``buckets`` exist (as ``root/<bucket>``) while the block runs. TensorStore reads
    its endpoint once per process, so one server serves every call; it follows
    ``root``.
    """
    for bucket in buckets:
        os.makedirs(os.path.join(root, bucket), exist_ok=True)
    server = _SERVER.get("server")
    if server is None:
        server = FakeGcsServer(root).start()
        _SERVER["server"] = server
    server.root = root
    server.generations.clear()
    env = {
        "TENSORSTORE_GCS_HTTP_URL": server.url,
        "GOOGLE_AUTH_TOKEN_FOR_TESTING": "fake-token",
        "TENSORSTORE_GCS_HTTP_VERSION": "1.1",
    }
    saved_env = {key: os.environ.get(key) for key in env}
    saved_impl = {p: fsspec.registry.get(p) for p in ("gs", "gcs")}
    os.environ.update(env)
    for protocol in ("gs", "gcs"):
        fsspec.register_implementation(protocol, FakeGcsFileSystem, clobber=True)
    FakeGcsFileSystem.root = root
    FakeGcsFileSystem.clear_instance_cache()
    _clear_epath_filesystem_cache()
    try:
        with _storage_client_stand_in():
            yield server
    finally:
        FakeGcsFileSystem.root = ""
        FakeGcsFileSystem.clear_instance_cache()
        _clear_epath_filesystem_cache()
        for protocol, impl in saved_impl.items():
            if impl is not None:
                fsspec.register_implementation(protocol, impl, clobber=True)
            else:
                sys.modules["fsspec.registry"]._registry.pop(protocol, None)
        for key, value in saved_env.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


_SERVER: dict[str, FakeGcsServer] = {}


class _FakeBucket:
    hierarchical_namespace_enabled = False

    def __init__(self, name: str):
        self.name = name


class _FakeStorageClient:
    """What Orbax calls of ``google.cloud.storage.Client``: ``get_bucket``."""

    def get_bucket(self, name: str) -> _FakeBucket:
        if not os.path.isdir(os.path.join(FakeGcsFileSystem.root, name)):
            raise LookupError(f"fake GCS: no bucket {name!r}")
        return _FakeBucket(name)


@contextlib.contextmanager
def _storage_client_stand_in() -> Iterator[None]:
    """Provides ``google.cloud.storage`` (a client of the fake buckets) if it is missing."""
    try:
        from google.cloud import storage  # noqa: F401

        installed = True
    except ImportError:
        installed = False
    if installed:  # the real client would need credentials and a server: not supported
        raise RuntimeError("fake_gcs cannot stand in for an installed google-cloud-storage")
    cloud = types.ModuleType("google.cloud")
    storage_module = types.ModuleType("google.cloud.storage")
    storage_module.Client = _FakeStorageClient
    cloud.storage = storage_module
    cloud.__path__ = []
    saved = {name: sys.modules.get(name) for name in ("google.cloud", "google.cloud.storage")}
    sys.modules["google.cloud"] = cloud
    sys.modules["google.cloud.storage"] = storage_module
    from orbax.checkpoint._src.path import gcs_utils

    gcs_utils.get_bucket.cache_clear()
    try:
        yield
    finally:
        gcs_utils.get_bucket.cache_clear()
        for name, module in saved.items():
            if module is None:
                sys.modules.pop(name, None)
            else:
                sys.modules[name] = module


def _clear_epath_filesystem_cache() -> None:
    """epath caches one fsspec filesystem per protocol; a new root needs a new one."""
    from etils.epath import backend

    backend.fsspec_backend._get_filesystem.cache_clear()
