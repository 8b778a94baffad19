"""`gs://` without a network: Cloud Storage's two client paths served from one local folder.

Orbax writes a checkpoint through two clients: TensorStore (the arrays) speaks Cloud
Storage's JSON API over HTTP, and etils.epath (metadata, and our own files) goes through
fsspec's `gcs` protocol. Here both land in `root/<bucket>/<object name>`:

- `serve(root)` answers the JSON API calls TensorStore makes (media upload, ranged and
  conditional reads, listing, delete) on 127.0.0.1; `TENSORSTORE_GCS_HTTP_URL` points
  TensorStore at it;
- `BucketFolders` is fsspec's `gcs` protocol as a view of the same folder.
"""

from __future__ import annotations

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import parse_qs, unquote, urlparse

from fsspec.implementations.dirfs import DirFileSystem
from fsspec.implementations.local import LocalFileSystem


class BucketFolders(DirFileSystem):
    """fsspec's `gs://` / `gcs://` as folders under `root` (set before first use)."""

    protocol = ("gs", "gcs")
    root: Path | None = None

    def __init__(self, **_options):  # epath passes GCS options (finalize_on_close) that a folder ignores
        super().__init__(path=str(self.root), fs=LocalFileSystem(auto_mkdir=True))


def _generation(path: Path) -> int:
    return path.stat().st_mtime_ns or 1


def _resource(bucket: str, name: str, path: Path) -> dict:
    generation = str(_generation(path))
    return {"kind": "storage#object", "bucket": bucket, "name": name, "size": str(path.stat().st_size),
            "generation": generation, "metageneration": "1"}


class _Handler(BaseHTTPRequestHandler):
    root: Path
    protocol_version = "HTTP/1.1"  # keep-alive, and `Expect: 100-continue` answered at once

    def log_message(self, *args):  # quiet
        pass

    def _parse(self):
        url = urlparse(self.path)
        query = {k: v[0] for k, v in parse_qs(url.query).items()}
        parts = url.path.split("/")
        # /storage/v1/b/<bucket>/o[/<object>]  or  /upload/storage/v1/b/<bucket>/o
        at = parts.index("b")
        bucket = parts[at + 1]
        if len(parts) == at + 2:  # the bucket itself
            return bucket, None, {**query, "bucket": True}
        name = unquote("/".join(parts[at + 3 :])) if len(parts) > at + 3 else query.get("name")
        return bucket, name, query

    def _send(self, status: int, body: bytes = b"", headers: dict | None = None, content_type="application/json"):
        self.send_response(status)
        for key, value in (headers or {}).items():
            self.send_header(key, value)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(body)

    def _json(self, status: int, value: dict, headers: dict | None = None):
        self._send(status, json.dumps(value).encode(), headers)

    def _precondition(self, path: Path, query: dict) -> int | None:
        """HTTP status when a generation condition fails (412), else None."""
        current = _generation(path) if path.is_file() else 0
        if "ifGenerationMatch" in query and int(query["ifGenerationMatch"]) != current:
            return 412
        if "ifGenerationNotMatch" in query and int(query["ifGenerationNotMatch"]) == current:
            return 304
        return None

    def do_GET(self):
        bucket, name, query = self._parse()
        if query.get("bucket"):  # Orbax asks whether the bucket has folders (hierarchical namespace)
            return self._json(200, {"kind": "storage#bucket", "name": bucket, "hierarchicalNamespace": {"enabled": False}})
        if not name:  # list the bucket
            prefix = query.get("prefix", "")
            start, end = query.get("startOffset", ""), query.get("endOffset")
            base = self.root / bucket
            names = sorted(str(p.relative_to(base)) for p in base.rglob("*") if p.is_file()) if base.is_dir() else []
            items = [_resource(bucket, n, base / n) for n in names
                     if n.startswith(prefix) and n >= start and (end is None or n < end)]
            return self._json(200, {"kind": "storage#objects", "items": items})
        path = self.root / bucket / name
        if not path.is_file():
            return self._json(404, {"error": {"code": 404, "message": f"No such object: {bucket}/{name}"}})
        failed = self._precondition(path, query)
        if failed:
            return self._send(failed)
        headers = {"x-goog-generation": str(_generation(path))}
        if query.get("alt") != "media":
            return self._json(200, _resource(bucket, name, path), headers)
        data = path.read_bytes()
        ranged = self.headers.get("Range")
        if ranged:
            first, _, last = ranged.removeprefix("bytes=").partition("-")
            if first == "":  # suffix: the last N bytes
                first, last = max(len(data) - int(last), 0), len(data) - 1
            first, last = int(first), min(int(last) if last else len(data) - 1, len(data) - 1)
            headers["Content-Range"] = f"bytes {first}-{last}/{len(data)}"
            return self._send(206, data[first : last + 1], headers, "application/octet-stream")
        return self._send(200, data, headers, "application/octet-stream")

    def do_POST(self):
        bucket, name, query = self._parse()
        path = self.root / bucket / name
        data = self.rfile.read(int(self.headers.get("Content-Length", 0)))
        failed = self._precondition(path, query)
        if failed:
            return self._send(412)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(data)
        self._json(200, _resource(bucket, name, path))

    def do_DELETE(self):
        bucket, name, query = self._parse()
        path = self.root / bucket / name
        if not path.is_file():
            return self._json(404, {"error": {"code": 404, "message": "No such object"}})
        failed = self._precondition(path, query)
        if failed:
            return self._send(412)
        path.unlink()
        self._send(204)


def serve(root: Path) -> ThreadingHTTPServer:
    """The JSON API over `root` on a free port of 127.0.0.1, in a daemon thread; `.shutdown()` stops it."""
    handler = type("Handler", (_Handler,), {"root": root})
    server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server
