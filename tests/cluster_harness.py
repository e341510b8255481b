"""Several real `exo-like` processes on loopback, linked by --peers (no multicast needed)."""

from __future__ import annotations

import json
import select
import socket
import socketserver
import threading
import time
from pathlib import Path
from typing import Any, Callable

from tests.api_server import NodeProcess, start_node


def free_ports(count: int) -> list[int]:
    sockets = [socket.socket() for _ in range(count)]
    try:
        for s in sockets:
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in sockets]
    finally:
        for s in sockets:
            s.close()


def start_cluster(root: Path, model: str | None, memories_gb: list[float], engines: list[str] | None = None,
                  extra: tuple[str, ...] = (), threads: int = 1, envs: list[dict[str, str | None]] | None = None,
                  preexecs: list[Callable[[], None] | None] | None = None,
                  node_ids: list[str] | None = None) -> list[NodeProcess]:
    """Nodes node0, node1, ... in homes <root>/home0, ... (node_ids: the ids they take, e.g. to fix the ring's
    order among nodes of equal memory; preexecs: what each process runs before exo-like, see start_node)."""
    ports = free_ports(len(memories_gb))
    peers = ",".join(f"127.0.0.1:{p}" for p in ports)
    engines = engines or ["torch"] * len(memories_gb)
    nodes = []
    try:
        for i, (memory, engine, port) in enumerate(zip(memories_gb, engines, ports)):
            if node_ids is not None:
                seed_identity(root / f"home{i}", node_ids[i])
            nodes.append(start_node(root / f"home{i}", model, "--no-mdns", "--peers", peers, "--memory-gb",
                                    str(memory), "--node-name", f"node{i}", "--engine", engine,
                                    "--dtype", "float32", *extra, port=port, threads=threads,
                                    env=envs[i] if envs else None, preexec=preexecs[i] if preexecs else None))
    except BaseException:
        for node in nodes:
            node.stop()
        raise
    return nodes


def seed_identity(home: Path, node_id: str) -> None:
    """Make the next node started alone in `home` take `node_id` (exo_like/identity.py's slot 0)."""
    folder = home / "identity"
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "node-0.json").write_text(json.dumps({"node_id": node_id}))


def cluster_of(node: NodeProcess) -> dict[str, Any]:
    return node.get_json("/v1/cluster")


def wait_until_ready(nodes: list[NodeProcess], members: int, timeout: float = 60) -> float:
    """Seconds until every node reports an agreed, ready plan over `members` nodes."""
    started = time.monotonic()
    deadline = started + timeout
    while time.monotonic() < deadline:
        views = [_view(node) for node in nodes]
        if all(v and v["ready"] and v["agreed"] and len(v["nodes"]) == members for v in views):
            digests = {v["plan"]["digest"] for v in views}
            if len(digests) == 1:
                return time.monotonic() - started
        time.sleep(0.05)
    raise AssertionError(f"cluster not ready in {timeout}s: {[_view(n) for n in nodes]}")


def _view(node: NodeProcess) -> dict[str, Any] | None:
    try:
        return cluster_of(node)
    except (AssertionError, OSError):
        return None


class _RelayServer(socketserver.ThreadingTCPServer):
    allow_reuse_address = True
    daemon_threads = True


class LateRelay:
    """A loopback port that refuses connections until `open()`, then forwards each one to `target_port`.

    A node given it in --peers is started in advance (its start takes seconds) yet reaches its peer only when the
    test says, e.g. in the middle of a stream. The address is one the peer does not advertise, like a bootstrap
    address across a VPN or NAT."""

    def __init__(self, target_port: int):
        self.port = free_ports(1)[0]
        self.target_port = target_port
        self._server: socketserver.ThreadingTCPServer | None = None
        self._closed = threading.Event()

    def open(self) -> None:
        relay = self

        class Forward(socketserver.BaseRequestHandler):
            def handle(self) -> None:
                with socket.create_connection(("127.0.0.1", relay.target_port)) as upstream:
                    relay._pipe(self.request, upstream)

        self._server = _RelayServer(("127.0.0.1", self.port), Forward)
        threading.Thread(target=self._server.serve_forever, daemon=True).start()

    def _pipe(self, a: socket.socket, b: socket.socket) -> None:
        while not self._closed.is_set():
            readable, _, _ = select.select([a, b], [], [], 0.5)
            for source in readable:
                try:
                    data = source.recv(65536)
                    if data:
                        (b if source is a else a).sendall(data)
                except OSError:  # one side reset the connection (a node killed)
                    data = b""
                if not data:
                    return

    def close(self) -> None:
        self._closed.set()
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
