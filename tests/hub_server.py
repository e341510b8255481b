"""A Hugging Face hub on loopback, for the download tests: generated checkpoints in the hub's URL layout.

What huggingface_hub 2.x asks of a hub, and what this server answers:
- GET /api/models/{repo}[/revision/{rev}][?blobs=true]: the commit sha and the files (size and LFS sha256 with
  blobs); 404 + X-Error-Code RepoNotFound for an unknown repo, RevisionNotFound for an unknown revision.
- GET /api/models/{repo}/tree/{rev}: the file listing snapshot_download reads.
- HEAD/GET /{repo}/resolve/{rev}/{file}: small files directly (ETag = git blob id, X-Repo-Commit); LFS files
  (*.safetensors, *.gguf; in subfolders too) as a 302 to a CDN on another port, with X-Linked-Etag (the sha256)
  and X-Linked-Size, as the real hub does. A gated repo answers 401 + X-Error-Code GatedRepo without the right
  bearer token.
- GET /cdn/{sha256} on the CDN port: the bytes, with Range requests (206) for resumed downloads and byte ranges.

Every request is logged with the bytes sent and the client's `origin/...` user-agent tag (HF_HUB_USER_AGENT_ORIGIN),
so a test can tell which node fetched what. `cut(...)` makes the next download of a file stop after N bytes.
"""

from __future__ import annotations

import hashlib
import json
import re
import socket
import threading
import time
from dataclasses import dataclass, field, replace
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import parse_qs, unquote, urlsplit

TOKEN = "hf_exo_like_test_token"
CHUNK = 16 * 1024
_API = re.compile(r"^/api/models/([^/]+/[^/]+)(?:/(revision|tree)/([^/]+))?/?$")
_RESOLVE = re.compile(r"^/([^/]+/[^/]+)/resolve/([^/]+)/(.+)$")
_CDN = re.compile(r"^/cdn/([0-9a-f]{64})$")
_ORIGIN = re.compile(r"origin/([^;\s]+)")


@dataclass(frozen=True)
class HubFile:
    path: Path
    size: int
    sha256: str
    git_oid: str  # what git would call the blob (for files not in LFS)

    @property
    def lfs(self) -> bool:
        return self.path.suffix in (".safetensors", ".gguf")


@dataclass
class HubRepo:
    repo_id: str
    files: dict[str, HubFile]
    gated: bool = False

    @property
    def commit(self) -> str:
        content = json.dumps(sorted((name, f.sha256) for name, f in self.files.items()))
        return hashlib.sha1(f"{self.repo_id}\n{content}".encode()).hexdigest()


@dataclass(frozen=True)
class Served:
    """One request as the server saw it."""

    method: str
    path: str
    status: int
    origin: str | None
    file: str | None = None  # repo file name, for resolve and CDN requests
    range_start: int | None = None
    bounded: bool = False  # the Range had an end: a peek at the header, not a download of the file
    bytes_sent: int = 0


@dataclass
class _Cut:
    after: int  # bytes of the file to send before dropping the connection
    tripped: bool = False


@dataclass
class HubServer:
    repos: dict[str, HubRepo] = field(default_factory=dict)
    earlier: dict[str, dict[str, HubRepo]] = field(default_factory=dict)  # repo id -> commit -> older version
    tags: dict[str, dict[str, str]] = field(default_factory=dict)  # repo id -> tag (or branch) -> commit
    log: list[Served] = field(default_factory=list)
    throttle: float | None = None  # bytes/s for file downloads from the CDN (header peeks are never slowed)
    _cuts: dict[str, _Cut] = field(default_factory=dict)  # sha256 -> cut
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def add_repo(self, repo_id: str, folder: Path, gated: bool = False) -> HubRepo:
        """Publish `folder` as the repo's main. Publishing again is a new commit; older ones stay fetchable."""
        files = {p.relative_to(folder).as_posix(): _hub_file(p) for p in sorted(folder.rglob("*")) if p.is_file()}
        if repo_id in self.repos:
            old = self.repos[repo_id]
            self.earlier.setdefault(repo_id, {})[old.commit] = old
        self.repos[repo_id] = HubRepo(repo_id, files, gated)
        return self.repos[repo_id]

    def tag(self, repo_id: str, name: str, commit: str) -> None:
        """Name a commit of the repo (a tag, or a branch other than main)."""
        self.tags.setdefault(repo_id, {})[name] = commit

    def version(self, repo_id: str, revision: str | None) -> HubRepo | None:
        """The repo at a revision: main (None or "main"), a tag, its current commit, or an earlier commit."""
        repo = self.repos.get(repo_id)
        revision = self.tags.get(repo_id, {}).get(revision or "", revision)
        if repo is None or revision in (None, "main", repo.commit):
            return repo
        return self.earlier.get(repo_id, {}).get(revision)

    def start(self) -> "HubServer":
        self._hub = _server(self, cdn=False)
        self._cdn = _server(self, cdn=True)
        for server in (self._hub, self._cdn):
            threading.Thread(target=server.serve_forever, daemon=True).start()
        return self

    def stop(self) -> None:
        for server in (self._hub, self._cdn):
            server.shutdown()
            server.server_close()

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self._hub.server_address[1]}"

    @property
    def cdn(self) -> str:
        return f"http://127.0.0.1:{self._cdn.server_address[1]}"

    def cut(self, repo_id: str, name: str, after: int) -> None:
        """The next download of the file stops after `after` bytes (connection dropped); the ones after that get
        503 until uncut(), so a client cannot finish it by retrying."""
        with self._lock:
            self._cuts[self.repos[repo_id].files[name].sha256] = _Cut(after)

    def uncut(self) -> None:
        with self._lock:
            self._cuts.clear()

    def record(self, served: Served) -> int:
        """Log a request; returns its entry's index (for amend)."""
        with self._lock:
            self.log.append(served)
            return len(self.log) - 1

    def amend(self, entry: int, served: Served) -> None:
        with self._lock:
            self.log[entry] = served

    def requests(self, origin: str | None = None, since: int = 0) -> list[Served]:
        """The log from entry `since` on (len(requests()) before an action: what the action caused)."""
        with self._lock:
            return [r for r in self.log[since:] if origin is None or r.origin == origin]

    def weight_downloads(self, origin: str | None = None, since: int = 0) -> list[Served]:
        """Body transfers of weight files (not the header peeks the planner makes with small Range requests)."""
        return [r for r in self.requests(origin, since) if r.path.startswith("/cdn/") and r.method == "GET"
                and r.file is not None and r.status in (200, 206) and not r.bounded]

    def take_cut(self, sha256: str) -> _Cut | None:
        with self._lock:
            cut = self._cuts.get(sha256)
            if cut is None:
                return None
            result = _Cut(cut.after, cut.tripped)
            cut.tripped = True
            return result

    def file_by_sha(self, sha256: str) -> HubFile | None:
        versions = [*self.repos.values(), *(old for by_commit in self.earlier.values() for old in by_commit.values())]
        for repo in versions:
            for file in repo.files.values():
                if file.sha256 == sha256:
                    return file
        return None


def _hub_file(path: Path) -> HubFile:
    data = path.read_bytes()
    git_oid = hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()
    return HubFile(path, len(data), hashlib.sha256(data).hexdigest(), git_oid)


def _server(hub: HubServer, cdn: bool) -> ThreadingHTTPServer:
    handler = type("Handler", (_Handler,), {"hub": hub, "is_cdn": cdn})
    server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    server.daemon_threads = True
    return server


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    hub: HubServer
    is_cdn: bool

    def log_message(self, format: str, *args: object) -> None:  # noqa: A002 - quiet: the hub keeps its own log
        pass

    def do_HEAD(self) -> None:  # noqa: N802
        self._route()

    def do_GET(self) -> None:  # noqa: N802
        self._route()

    # -- routing --------------------------------------------------------------------------------------------

    def _route(self) -> None:
        url = urlsplit(self.path)
        path = unquote(url.path)
        if self.is_cdn:
            match = _CDN.match(path)
            return self._cdn(match.group(1)) if match else self._error(404, "EntryNotFound", "not found")
        if match := _API.match(path):
            return self._api(match.group(1), match.group(2), match.group(3), parse_qs(url.query))
        if match := _RESOLVE.match(path):
            return self._resolve(match.group(1), match.group(2), match.group(3))
        self._error(404, None, f"no route {path}")

    def _repo(self, repo_id: str, revision: str | None) -> HubRepo | None:
        if repo_id not in self.hub.repos:
            self._error(404, "RepoNotFound", "Repository not found")
            return None
        repo = self.hub.version(repo_id, revision)
        if repo is None:
            self._error(404, "RevisionNotFound", "Invalid rev id")
        return repo

    def _api(self, repo_id: str, kind: str | None, revision: str | None, query: dict[str, list[str]]) -> None:
        repo = self._repo(repo_id, revision)
        if repo is None:
            return
        if kind == "tree":
            return self._json([_tree_entry(name, f) for name, f in repo.files.items()])
        blobs = query.get("blobs", ["false"])[0].lower() == "true"
        siblings = [_sibling(name, f, blobs) for name, f in repo.files.items()]
        self._json({"_id": repo.commit[:24], "id": repo.repo_id, "modelId": repo.repo_id, "sha": repo.commit,
                    "private": False, "gated": "manual" if repo.gated else False, "disabled": False,
                    "downloads": 0, "likes": 0, "tags": [], "library_name": "transformers", "siblings": siblings,
                    "createdAt": "2025-01-01T00:00:00.000Z", "lastModified": "2025-01-01T00:00:00.000Z"})

    def _resolve(self, repo_id: str, revision: str, name: str) -> None:
        repo = self._repo(repo_id, revision)
        if repo is None:
            return
        if repo.gated and self.headers.get("Authorization") != f"Bearer {TOKEN}":
            return self._error(401, "GatedRepo", f"Access to model {repo_id} is restricted. You must have access "
                                                 f"to it and be authenticated to access it. Please log in.")
        file = repo.files.get(name)
        if file is None:
            return self._error(404, "EntryNotFound", "Entry not found", {"X-Repo-Commit": repo.commit})
        headers = {"X-Repo-Commit": repo.commit}
        if file.lfs:
            headers.update({"Location": f"{self.hub.cdn}/cdn/{file.sha256}", "X-Linked-Etag": f'"{file.sha256}"',
                            "X-Linked-Size": str(file.size), "ETag": f'"{file.git_oid}"', "Content-Length": "0"})
            self._respond(302, headers)
            self.hub.record(Served(self.command, self.path, 302, self._origin(), name))
            return
        self._send_file(file, name, {**headers, "ETag": f'"{file.git_oid}"'})

    def _cdn(self, sha256: str) -> None:
        file = self.hub.file_by_sha(sha256)
        if file is None:
            return self._error(404, "EntryNotFound", "not found")
        downloading = self.command == "GET" and not re.match(r"bytes=\d+-\d+$", self.headers.get("Range", ""))
        cut = self.hub.take_cut(sha256) if downloading else None  # header peeks (bounded ranges) pass
        if cut is not None and cut.tripped:
            return self._error(503, None, "unavailable (cut by the test)")
        self._send_file(file, file.path.name, {"ETag": f'"{sha256}"'}, cut.after if cut else None)

    # -- responses ------------------------------------------------------------------------------------------

    def _send_file(self, file: HubFile, name: str, headers: dict[str, str], cut_after: int | None = None) -> None:
        start, end = self._range(file.size)
        status = 206 if self.headers.get("Range") else 200
        headers = {**headers, "Accept-Ranges": "bytes", "Content-Length": str(end - start),
                   "Content-Type": "application/octet-stream"}
        if status == 206:
            headers["Content-Range"] = f"bytes {start}-{end - 1}/{file.size}"
        self._respond(status, headers)
        header = self.headers.get("Range")
        bounded = bool(header) and not header.endswith("-")
        stop = end if cut_after is None else max(start, min(end, cut_after))
        served = Served(self.command, self.path, status, self._origin(), name, start if header else None, bounded,
                        stop - start if self.command == "GET" else 0)
        # Logged before the body goes out: a client that has every byte may look at the log at once (the last
        # chunk's throttle pause, or a busy machine, would otherwise let the entry land after it looked).
        entry = self.hub.record(served)
        if self.command == "GET":
            sent = self._write_body(file.path, start, stop, throttled=not bounded)
            if sent < stop - start:
                self.close_connection = True  # the client went away (a stopped node): log what it was sent
                self.hub.amend(entry, replace(served, bytes_sent=sent))
            elif stop < end:  # the cut: drop the connection in the middle of the body
                self.close_connection = True
                self.connection.shutdown(socket.SHUT_RDWR)

    def _write_body(self, path: Path, start: int, stop: int, throttled: bool) -> int:
        """Send the bytes [start, stop); file downloads (not header peeks) at `hub.throttle` bytes per second.
        Returns how many were sent (fewer if the client went away)."""
        sent = 0
        with open(path, "rb") as f:
            f.seek(start)
            while sent < stop - start:
                chunk = f.read(min(CHUNK, stop - start - sent))
                try:
                    self.wfile.write(chunk)
                    self.wfile.flush()
                except (BrokenPipeError, ConnectionResetError):
                    return sent  # the client went away
                sent += len(chunk)
                if throttled and self.hub.throttle:
                    time.sleep(len(chunk) / self.hub.throttle)
        return sent

    def _range(self, size: int) -> tuple[int, int]:
        """[start, end) of a `bytes=a-b` or `bytes=a-` Range header (the whole file without one)."""
        header = self.headers.get("Range")
        match = re.match(r"bytes=(\d+)-(\d*)$", header or "")
        if match is None:
            return 0, size
        start = int(match.group(1))
        end = int(match.group(2)) + 1 if match.group(2) else size
        return min(start, size), min(end, size)

    def _json(self, body: object) -> None:
        data = json.dumps(body).encode()
        self._respond(200, {"Content-Type": "application/json", "Content-Length": str(len(data))})
        if self.command == "GET":
            self.wfile.write(data)
        self.hub.record(Served(self.command, self.path, 200, self._origin()))

    def _error(self, status: int, code: str | None, message: str, extra: dict[str, str] | None = None) -> None:
        data = json.dumps({"error": message}).encode()
        headers = {"Content-Type": "application/json", "Content-Length": str(len(data)), "X-Error-Message": message,
                   **({"X-Error-Code": code} if code else {}), **(extra or {})}
        self._respond(status, headers)
        if self.command == "GET":
            self.wfile.write(data)
        self.hub.record(Served(self.command, self.path, status, self._origin()))

    def _respond(self, status: int, headers: dict[str, str]) -> None:
        self.send_response(status)
        for name, value in headers.items():
            self.send_header(name, value)
        self.end_headers()

    def _origin(self) -> str | None:
        match = _ORIGIN.search(self.headers.get("User-Agent", ""))
        return match.group(1) if match else None


def _tree_entry(name: str, file: HubFile) -> dict[str, object]:
    entry: dict[str, object] = {"type": "file", "oid": file.git_oid, "size": file.size, "path": name}
    if file.lfs:
        entry["lfs"] = {"oid": file.sha256, "size": file.size, "pointerSize": 134}
    return entry


def _sibling(name: str, file: HubFile, blobs: bool) -> dict[str, object]:
    if not blobs:
        return {"rfilename": name}
    sibling: dict[str, object] = {"rfilename": name, "size": file.size, "blobId": file.git_oid}
    if file.lfs:
        sibling["lfs"] = {"sha256": file.sha256, "size": file.size, "pointerSize": 134}
    return sibling
