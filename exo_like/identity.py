"""Persistent node identity: a random id kept in the home folder, one per port.

Keyed by port so two nodes sharing a host and a home folder still get distinct ids, while a node restarted on
the same port keeps its id (exo's first generation derived ids in ways that collided).
"""

from __future__ import annotations

import json
import os
import socket
import uuid
from pathlib import Path


def load_or_create_node_id(home: Path, port: int) -> str:
    path = home / "identity" / f"node-{port}.json"
    if path.exists():
        try:
            return str(json.loads(path.read_text())["node_id"])
        except (ValueError, KeyError):
            pass  # corrupt file: replace it below
    node_id = uuid.uuid4().hex[:16]
    path.parent.mkdir(parents=True, exist_ok=True)
    staging = path.with_suffix(f".tmp{os.getpid()}")
    staging.write_text(json.dumps({"node_id": node_id}))
    os.replace(staging, path)
    return node_id


def default_node_name() -> str:
    return socket.gethostname() or "node"
