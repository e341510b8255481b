"""Persistent node identity: a random id kept in the home folder, unique among nodes sharing that folder.

Each running node claims an identity slot by holding an exclusive lock on the slot's lock file for its whole
life. A node restarted alone gets slot 0 and its old id back; a second node started on the same host and home
finds slot 0 locked and takes slot 1, so ids never collide (exo's first generation had colliding ids).
"""

from __future__ import annotations

import fcntl
import json
import os
import socket
import uuid
from pathlib import Path
from typing import IO

MAX_SLOTS = 256


class NodeIdentity:
    def __init__(self, node_id: str, slot: int, lock: IO[bytes]):
        self.node_id = node_id
        self.slot = slot
        self._lock = lock  # kept open: the OS lock lasts as long as this process

    def release(self) -> None:
        self._lock.close()


def claim_identity(home: Path) -> NodeIdentity:
    folder = home / "identity"
    folder.mkdir(parents=True, exist_ok=True)
    for slot in range(MAX_SLOTS):
        lock = open(folder / f"slot-{slot}.lock", "wb")
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            lock.close()
            continue
        return NodeIdentity(_load_or_create(folder / f"node-{slot}.json"), slot, lock)
    raise RuntimeError(f"more than {MAX_SLOTS} nodes share the home folder {home}")


def _load_or_create(path: Path) -> str:
    if path.exists():
        try:
            return str(json.loads(path.read_text())["node_id"])
        except (ValueError, KeyError):
            pass  # corrupt file: replace it below
    node_id = uuid.uuid4().hex[:16]
    staging = path.with_suffix(f".tmp{os.getpid()}")
    staging.write_text(json.dumps({"node_id": node_id}))
    os.replace(staging, path)
    return node_id


def default_node_name() -> str:
    return socket.gethostname() or "node"
