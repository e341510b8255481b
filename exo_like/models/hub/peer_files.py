"""Models from the cluster's other nodes instead of the hub: the hub sees each byte at most once per cluster.

A node serves, to peers that prove the cluster key:
- the files its cache holds whole, and the weight file it is fetching from the hub right now, as it grows
  (GET /v1/peer/files/<org>/<name>/<commit>/<file>, Range supported; 503 + Retry-After for one it will fetch soon);
- a commit's description: its saved manifest (weight files, their hashes, bytes per layer) and which of the small
  files it holds (GET /v1/peer/descriptions/<org>/<name>/<commit>);
- the key a name resolved to on it (GET /v1/peer/names?name=...), so a node without the hub learns which commit a
  name means where a peer holds it.

A node that needs a weight file asks first the plan member chosen to fetch it from the hub (the lowest id among
the members whose layers need it: it waits for that one while it says the file is coming), then the peers that
hold it, then the hub. A node that needs a description of a commit asks its peers before the hub, and a name the
hub cannot resolve (unreachable, or --no-downloads) is asked of the peers.

A peer proves the key by an HMAC of its node id and the path (the key never crosses the network). Weight files are
checked as the hub's are, against the SHA-256 of the manifest; the small files (config, tokenizer) have no hash in
it and are taken from the authenticated peer as they are.
"""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import http.client
import json
import logging
import time
import urllib.error
import urllib.request
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO, Literal, Protocol
from urllib.parse import quote, urlencode

from huggingface_hub.file_download import REGEX_COMMIT_HASH

from exo_like.models.hub.repo import (
    MANIFEST_FOLDER,
    META_FILES,
    RepoManifest,
    blob_path,
    link_blob,
    manifest_path,
    save_manifest,
    storage_folder,
)

log = logging.getLogger(__name__)

PEER_FILES_PATH = "/v1/peer/files"
PEER_DESCRIPTIONS_PATH = "/v1/peer/descriptions"
PEER_NAMES_PATH = "/v1/peer/names"
NODE_HEADER = "X-Exo-Like-Node"
PROOF_HEADER = "X-Exo-Like-Proof"
# Sent by a node waiting for the member chosen to fetch a file: only it is answered with a file still growing, or
# 503 for one queued (another asker takes whole files only: two nodes must never wait on each other's copies).
WAIT_HEADER = "X-Exo-Like-Wait"
READ_CHUNK = 1 << 20
TIMEOUT_SECONDS = 30.0  # a peer silent this long mid-file is given up on: the hub (or the next peer) resumes
RETRY_SECONDS = 1.0  # how soon the chosen fetcher is asked again while it says the file is coming
# How long the chosen fetcher may say it has no such file before this node asks elsewhere: the plan reaches the
# members a moment apart, and a fetcher that has not got it yet knows of no file to fetch.
GRACE_SECONDS = 10.0
GROWING_POLL_SECONDS = 0.05  # how often a file being fetched is looked at for new bytes, for a peer reading it

Outcome = Literal["done", "failed", "later", "absent"]


def proof(cluster_key: str, node_id: str, path: str) -> str:
    return hmac.new(cluster_key.encode(), f"{node_id}|{path}".encode(), hashlib.sha256).hexdigest()


def file_path(repo_id: str, commit: str, name: str) -> str:
    return f"{PEER_FILES_PATH}/{quote(repo_id)}/{quote(commit)}/{quote(name)}"


def description_path(repo_id: str, commit: str) -> str:
    return f"{PEER_DESCRIPTIONS_PATH}/{quote(repo_id)}/{quote(commit)}"


def proven(cluster_key: str, node_id: str, path: str, presented: str) -> bool:
    return hmac.compare_digest(proof(cluster_key, node_id, path).encode(), presented.encode())


def held_file(snapshots: Path, commit: str, name: str) -> Path | None:
    """The file of the commit this node's cache holds whole (its snapshot link exists only once verified), or None;
    names that would leave the snapshot folder are refused."""
    if not commit.isalnum() or name.startswith("/") or ".." in Path(name).parts:
        return None
    pointer = snapshots / commit / name
    return pointer if pointer.is_file() else None


def held_description(cache_dir: Path, repo_id: str, commit: str) -> dict[str, Any] | None:
    """A commit's description as this node holds it (its manifest is saved only once its small files are here):
    the manifest, and the small files held."""
    if not commit.isalnum():
        return None
    path = manifest_path(cache_dir, repo_id, commit)
    snapshots = storage_folder(cache_dir, repo_id) / "snapshots"
    if not path.is_file() or held_file(snapshots, commit, "config.json") is None:
        return None
    return {"manifest": json.loads(path.read_text()),
            "files": [name for name in META_FILES if held_file(snapshots, commit, name) is not None]}


def held_commit(cache_dir: Path, repo_id: str, revision: str | None) -> str | None:
    """The commit of the repo whose description this node holds that a name at `revision` means here: the commit
    itself, the one the cache's ref points to, else the one described last (a node that got the description from a
    peer has no refs)."""
    if revision is not None and REGEX_COMMIT_HASH.match(revision):
        return revision if held_description(cache_dir, repo_id, revision) is not None else None
    storage = storage_folder(cache_dir, repo_id)
    ref = storage / "refs" / (revision or "main")
    if ref.is_file():
        commit = ref.read_text().strip()
        return commit if held_description(cache_dir, repo_id, commit) is not None else None
    if revision not in (None, "main"):
        return None
    described = sorted((storage / MANIFEST_FOLDER).glob("*.json"), key=lambda path: path.stat().st_mtime)
    return next((path.stem for path in reversed(described) if held_description(cache_dir, repo_id, path.stem)),
                None)


async def growing_file(file: BinaryIO, start: int, size: int, finished: Callable[[], bool]) -> AsyncIterator[bytes]:
    """The bytes of a file another thread is appending to, from `start`, as they arrive: up to `size`, or fewer
    when the transfer ended without them (the reader's hash check, or its next source, deals with that). Opened
    once, the file stays readable when the transfer moves it into place."""
    file.seek(start)
    position = start
    while position < size:
        chunk = await asyncio.to_thread(file.read, min(READ_CHUNK, size - position))
        if chunk:
            position += len(chunk)
            yield chunk
        elif finished():
            chunk = await asyncio.to_thread(file.read, size - position)  # what it wrote just before it ended
            if chunk:
                yield chunk
            return
        else:
            await asyncio.sleep(GROWING_POLL_SECONDS)


class Appender(Protocol):
    @property
    def size(self) -> int: ...

    def write(self, chunk: bytes) -> int: ...

    def check(self) -> None:
        """Raise if the transfer should stop (the node stops, or no plan needs the file any more)."""


@dataclass(frozen=True)
class PeerSource:
    """A linked peer as a source of models: where it listens, and this node's proof for each path."""

    node_id: str
    base_url: str
    me: str
    cluster_key: str

    def fetch(self, repo_id: str, commit: str, name: str, writer: Appender, size: int, patient: bool = False) -> bool:
        """Append the file's bytes from writer.size on; whether the peer gave all of them (False: it holds no whole
        copy, or it failed; what arrived stays, for the next source to resume). `patient`: this peer is the one the
        plan chose to fetch the file from the hub, so wait while it says the file is coming (503), and for a grace
        period while it knows of no such file yet (404)."""
        grace_ends = time.monotonic() + GRACE_SECONDS
        while True:
            outcome = self._fetch_once(repo_id, commit, name, writer, size, patient)
            if outcome in ("done", "failed") or not patient:
                return outcome == "done"
            if outcome == "absent" and time.monotonic() > grace_ends:
                return False
            writer.check()
            time.sleep(RETRY_SECONDS)

    def _fetch_once(self, repo_id: str, commit: str, name: str, writer: Appender, size: int,
                    patient: bool) -> Outcome:
        start = writer.size
        headers = ({"Range": f"bytes={start}-"} if start else {}) | ({WAIT_HEADER: "1"} if patient else {})
        try:
            with self._open(file_path(repo_id, commit, name), headers) as response:
                if start and response.status != 206:
                    return "failed"  # not a resumable answer: the next source resumes instead
                while chunk := response.read(READ_CHUNK):
                    writer.write(chunk)
        except urllib.error.HTTPError as exc:
            if exc.code == 503:
                return "later"
            if exc.code != 404:
                log.warning("peer %s refused %s of %s (%s)", self.node_id, name, repo_id, exc.code)
            return "absent"
        except (urllib.error.URLError, OSError, http.client.HTTPException) as exc:
            log.warning("peer %s stopped sending %s of %s (%s); another source resumes it", self.node_id, name,
                        repo_id, exc)
            return "failed"
        if writer.size != size:
            return "failed"
        log.info("%s: %s fetched from peer %s (%d bytes)", repo_id, name, self.node_id, size - start)
        return "done"

    def describe(self, cache_dir: Path, repo_id: str, commit: str) -> Path | None:
        """Put the commit's description (small files, manifest) into this node's cache from the peer; the snapshot
        folder, or None if the peer does not hold it whole."""
        described = self._json(description_path(repo_id, commit))
        if described is None:
            return None
        manifest = RepoManifest.from_json(described["manifest"])
        if (manifest.repo_id, manifest.commit) != (repo_id, commit) or "config.json" not in described["files"]:
            return None
        contents = {}
        for name in described["files"]:
            if name not in META_FILES:
                return None
            data = self._bytes(file_path(repo_id, commit, name))
            if data is None:
                return None
            contents[name] = data
        snapshot = storage_folder(cache_dir, repo_id) / "snapshots" / commit
        for name, data in contents.items():
            blob = blob_path(cache_dir, repo_id, hashlib.sha256(data).hexdigest())
            blob.parent.mkdir(parents=True, exist_ok=True)
            blob.write_bytes(data)
            link_blob(blob, snapshot / name)
        save_manifest(cache_dir, manifest)  # last: a saved manifest says the small files are all here
        log.info("%s@%s: description (%s) from peer %s", repo_id, commit[:8], ", ".join(contents), self.node_id)
        return snapshot

    def key_of(self, name: str) -> str | None:
        """The cluster key (repo@commit[:TAG]) the peer resolves `name` to without the hub, if it can."""
        answer = self._json(f"{PEER_NAMES_PATH}?{urlencode({'name': name})}")
        key = answer.get("key") if answer is not None else None
        return key if isinstance(key, str) else None

    def _open(self, path: str, headers: dict[str, str] | None = None) -> http.client.HTTPResponse:
        signed = path.partition("?")[0]
        request = urllib.request.Request(self.base_url + path, headers={
            **(headers or {}), NODE_HEADER: self.me, PROOF_HEADER: proof(self.cluster_key, self.me, signed)})
        return urllib.request.urlopen(request, timeout=TIMEOUT_SECONDS)

    def _bytes(self, path: str) -> bytes | None:
        try:
            with self._open(path) as response:
                return response.read()
        except (urllib.error.URLError, OSError, http.client.HTTPException):
            return None

    def _json(self, path: str) -> Any:
        data = self._bytes(path)
        try:
            return json.loads(data) if data is not None else None
        except ValueError:
            return None


def described_by_peers(cache_dir: Path, repo_id: str, commit: str, peers: Sequence[PeerSource]) -> Path | None:
    """The snapshot folder of a commit whose description this node holds (its manifest is saved, so its small
    files are all here: a commit never changes, so the hub need not be asked), else from the first peer that
    holds it; None if neither does."""
    snapshot = storage_folder(cache_dir, repo_id) / "snapshots" / commit
    if manifest_path(cache_dir, repo_id, commit).is_file() and (snapshot / "config.json").is_file():
        return snapshot
    for peer in peers:
        folder = peer.describe(cache_dir, repo_id, commit)
        if folder is not None:
            return folder
    return None
