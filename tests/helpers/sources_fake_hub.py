"""A Hugging Face hub on 127.0.0.1 for tests: the endpoints huggingface_hub's model_info and
hf_hub_download use, answered the way the hub answers them.

    GET  /api/models/OWNER/NAME[/revision/REV]      {"id", "sha", "siblings": [{"rfilename", "size", "lfs"}]}
    HEAD /OWNER/NAME/resolve/REV/PATH               X-Repo-Commit, ETag (the sha256), Content-Length
    GET  /OWNER/NAME/resolve/REV/PATH               the bytes; `Range: bytes=N-` -> 206 + Content-Range

Errors carry the hub's X-Error-Code (RepoNotFound, RevisionNotFound, EntryNotFound), which is how
huggingface_hub tells them apart. Every request is logged in `hub.requests`; `hub.cut[path] = n`
makes the next GET of that file stop after n bytes (the connection is dropped mid-body).
`add_repo(..., token=T)` makes a gated repo: without `Authorization: Bearer T` the hub answers
403 with X-Error-Code GatedRepo, as it does for a gated model whose terms were not accepted.
"""

from __future__ import annotations

import hashlib
import json
import socket
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import unquote, urlsplit


class FakeHub:
    def __init__(self):
        self.repos: dict[str, dict] = {}
        self.requests: list[tuple[str, str, str | None]] = []  # (method, path, Range header)
        self.cut: dict[str, int] = {}
        self._server = ThreadingHTTPServer(("127.0.0.1", 0), _handler(self))
        self._server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self._server.server_address[1]}"
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)

    def add_repo(
        self, repo: str, files: dict[str, bytes | Path], commit: str | None = None, token: str | None = None
    ) -> str:
        blobs = {name: (data.read_bytes() if isinstance(data, Path) else data) for name, data in files.items()}
        commit = commit or hashlib.sha1(repo.encode() + b"".join(blobs[n] for n in sorted(blobs))).hexdigest()
        self.repos[repo] = {"sha": commit, "files": blobs, "token": token}
        return commit

    def start(self) -> "FakeHub":
        self._thread.start()
        return self

    def stop(self) -> None:
        self._server.shutdown()
        self._server.server_close()

    def gets(self, name: str) -> list[tuple[str, str, str | None]]:
        return [r for r in self.requests if r[0] == "GET" and r[1].endswith("/" + name)]


def dead_endpoint() -> str:
    """A 127.0.0.1 URL where nothing listens: the connection is refused at once (no network)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    return f"http://127.0.0.1:{port}"


def _handler(hub: FakeHub):
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, *args):  # quiet
            pass

        def do_GET(self):
            self._route(body=True)

        def do_HEAD(self):
            self._route(body=False)

        def _route(self, body: bool):
            path = unquote(urlsplit(self.path).path)
            hub.requests.append((self.command, path, self.headers.get("Range")))
            parts = path.strip("/").split("/")
            if parts[:2] == ["api", "models"] and len(parts) >= 4:
                repo = "/".join(parts[2:4])
                rev = parts[5] if len(parts) >= 6 and parts[4] == "revision" else "main"
                return self._info(repo, rev)
            if len(parts) >= 5 and parts[2] == "resolve":
                return self._file("/".join(parts[:2]), parts[3], "/".join(parts[4:]), body)
            self._error(404, "RepoNotFound")

        def _repo(self, repo: str, rev: str):
            r = hub.repos.get(repo)
            if r is None:
                self._error(404, "RepoNotFound")
            elif r["token"] and self.headers.get("Authorization") != f"Bearer {r['token']}":
                self._error(403, "GatedRepo")
            elif rev not in ("main", r["sha"]):
                self._error(404, "RevisionNotFound")
            else:
                return r
            return None

        def _info(self, repo: str, rev: str):
            r = self._repo(repo, rev)
            if r is None:
                return
            siblings = [
                {
                    "rfilename": n,
                    "size": len(b),
                    "blobId": hashlib.sha1(b).hexdigest(),
                    "lfs": {"size": len(b), "sha256": hashlib.sha256(b).hexdigest(), "pointerSize": 134},
                }
                for n, b in sorted(r["files"].items())
            ]
            data = json.dumps(
                {
                    "_id": repo,
                    "id": repo,
                    "modelId": repo,
                    "sha": r["sha"],
                    "private": False,
                    "tags": ["gguf"],
                    "siblings": siblings,
                }
            ).encode()
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def _file(self, repo: str, rev: str, name: str, body: bool):
            r = self._repo(repo, rev)
            if r is None:
                return
            data = r["files"].get(name)
            if data is None:
                return self._error(404, "EntryNotFound", commit=r["sha"])
            start, status = 0, 200
            rng = self.headers.get("Range")
            if rng and rng.startswith("bytes="):
                start, status = int(rng[6:].split("-")[0]), 206
            self.send_response(status)
            self.send_header("X-Repo-Commit", r["sha"])
            self.send_header("ETag", f'"{hashlib.sha256(data).hexdigest()}"')
            self.send_header("Accept-Ranges", "bytes")
            self.send_header("Content-Length", str(len(data) - start))
            if status == 206:
                self.send_header("Content-Range", f"bytes {start}-{len(data) - 1}/{len(data)}")
            self.end_headers()
            if not body:
                return
            cut = hub.cut.pop(name, None)
            if cut is not None:
                self.wfile.write(data[start:cut])
                self.wfile.flush()
                self.close_connection = True
                self.connection.shutdown(2)  # the peer sees the body end early
                return
            self.wfile.write(data[start:])

        def _error(self, status: int, code: str, commit: str | None = None):
            data = json.dumps({"error": code}).encode()
            self.send_response(status)
            self.send_header("X-Error-Code", code)
            if commit:
                self.send_header("X-Repo-Commit", commit)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

    return Handler
