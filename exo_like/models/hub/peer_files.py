"""Weight files from the cluster's other nodes instead of the hub: a node serves the files its cache holds whole
(GET /v1/peer/files/<org>/<name>/<commit>/<file>, Range supported), to peers that prove the cluster key, and a node
that needs a file asks its linked peers first, the hub only if none holds it.

A peer proves the key by an HMAC of its node id and the path (the key never crosses the network; a proof is good
for that one file, whose bytes the cluster shares anyway). What a peer sends is checked as the hub's is: the file's
SHA-256 from the hub's metadata, before it is used.
"""

from __future__ import annotations

import hashlib
import hmac
import logging
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol
from urllib.parse import quote

log = logging.getLogger(__name__)

PEER_FILES_PATH = "/v1/peer/files"
NODE_HEADER = "X-Exo-Like-Node"
PROOF_HEADER = "X-Exo-Like-Proof"
READ_CHUNK = 1 << 20
TIMEOUT_SECONDS = 30.0  # a peer silent this long mid-file is given up on: the hub (or the next peer) resumes


def proof(cluster_key: str, node_id: str, path: str) -> str:
    return hmac.new(cluster_key.encode(), f"{node_id}|{path}".encode(), hashlib.sha256).hexdigest()


def file_path(repo_id: str, commit: str, name: str) -> str:
    return f"{PEER_FILES_PATH}/{quote(repo_id)}/{quote(commit)}/{quote(name)}"


def proven(cluster_key: str, node_id: str, path: str, presented: str) -> bool:
    return hmac.compare_digest(proof(cluster_key, node_id, path).encode(), presented.encode())


def held_file(snapshots: Path, commit: str, name: str) -> Path | None:
    """The file of the commit this node's cache holds whole (its snapshot link exists only once verified), or None;
    names that would leave the snapshot folder are refused."""
    if not commit.isalnum() or name.startswith("/") or ".." in Path(name).parts:
        return None
    pointer = snapshots / commit / name
    return pointer if pointer.is_file() else None


class Appender(Protocol):
    @property
    def size(self) -> int: ...

    def write(self, chunk: bytes) -> int: ...


@dataclass(frozen=True)
class PeerSource:
    """A linked peer as a source of files: where it listens, and this node's proof for each path."""

    node_id: str
    base_url: str
    me: str
    cluster_key: str

    def fetch(self, repo_id: str, commit: str, name: str, writer: Appender, size: int) -> bool:
        """Append the file's bytes from writer.size on; whether the peer gave all of them (False: it holds no
        whole copy, or it failed; what arrived stays, for the next source to resume)."""
        path = file_path(repo_id, commit, name)
        headers = {NODE_HEADER: self.me, PROOF_HEADER: proof(self.cluster_key, self.me, path)}
        start = writer.size
        if start:
            headers["Range"] = f"bytes={start}-"
        request = urllib.request.Request(self.base_url + path, headers=headers)
        try:
            with urllib.request.urlopen(request, timeout=TIMEOUT_SECONDS) as response:
                if start and response.status != 206:
                    return False  # not a resumable answer: the next source resumes instead
                while chunk := response.read(READ_CHUNK):
                    writer.write(chunk)
        except urllib.error.HTTPError as exc:
            if exc.code != 404:
                log.warning("peer %s refused %s of %s (%s)", self.node_id, name, repo_id, exc.code)
            return False
        except (urllib.error.URLError, OSError) as exc:
            log.warning("peer %s stopped sending %s of %s (%s); another source resumes it", self.node_id, name,
                        repo_id, exc)
            return False
        if writer.size != size:
            return False
        log.info("%s: %s fetched from peer %s (%d bytes)", repo_id, name, self.node_id, size - start)
        return True

