"""Several real `exo-like` processes on loopback, linked by --peers (no multicast needed)."""

from __future__ import annotations

import json
import random
import select
import socket
import threading
import time
from pathlib import Path
from typing import Any, Callable

from tests.api_server import Launched, NodeProcess, launch_node


def free_ports(count: int) -> list[int]:
    """Ports free now, for servers a test starts later. Picked below the kernel's ephemeral range: the kernel hands
    ports in that range to every process's outgoing connections and port-0 binds, so one picked there can be taken
    (by a parallel test worker's connection) before the test binds it."""
    low = ephemeral_low()
    rng = random.SystemRandom()
    ports: list[int] = []
    while len(ports) < count:
        port = rng.randrange(max(1024, low - 12000), low)
        with socket.socket() as probe:
            try:
                probe.bind(("127.0.0.1", port))
            except OSError:
                continue
        if port not in ports:
            ports.append(port)
    return ports


def ephemeral_low() -> int:
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768  # Linux's default (macOS's is 49152: 32768 is below it too)


# Placed by memory: the split follows from the memories a test sets. By measured speed (the default) one fast node may
# rightly hold a tiny test model alone (a hop costs more than its layers), so a test asserting a split sets this.
BY_MEMORY = ("--placement", "memory")


def start_cluster(root: Path, model: str | None, memories_gb: list[float], engines: list[str] | None = None,
                  extra: tuple[str, ...] = (), threads: int = 1, envs: list[dict[str, str | None]] | None = None,
                  preexecs: list[Callable[[], None] | None] | None = None,
                  node_ids: list[str] | None = None, dtype: str | None = "float32") -> list[NodeProcess]:
    """Nodes node0, node1, ... in homes <root>/home0, ... (node_ids: the ids they take, e.g. to fix the ring's
    order among nodes of equal memory; preexecs: what each process runs before exo-like, see start_node; dtype:
    their --dtype, None for each engine's default)."""
    ports = free_ports(len(memories_gb))
    engines = engines or ["torch"] * len(memories_gb)
    # All launched before any is waited for: they start side by side, as a cluster's machines do.
    launched: list[Launched] = []
    try:
        for i, (memory, engine) in enumerate(zip(memories_gb, engines)):
            if node_ids is not None:
                seed_identity(root / f"home{i}", node_ids[i])
            launched.append(launch_member(root, model, ports, i, memory, engine, extra, threads, dtype,
                                          env=envs[i] if envs else None, preexec=preexecs[i] if preexecs else None))
        return [node.serving() for node in launched]
    except BaseException:
        for node in launched:
            node.stop()
        raise


def launch_member(root: Path, model: str | None, ports: list[int], i: int, memory_gb: float, engine: str = "torch",
                  extra: tuple[str, ...] = (), threads: int = 1, dtype: str | None = "float32",
                  env: dict[str, str | None] | None = None, preexec: Callable[[], None] | None = None) -> Launched:
    """Member i of a cluster of start_cluster's (on ports[i], in <root>/home<i>, every member a peer), as it
    starts it: also to start a member again after it was stopped or killed (it keeps its home, so its node id)."""
    peers = ",".join(f"127.0.0.1:{port}" for port in ports)
    return launch_node(root / f"home{i}", model, "--no-mdns", "--peers", peers, "--memory-gb", str(memory_gb),
                       "--node-name", f"node{i}", "--engine", engine, *(("--dtype", dtype) if dtype else ()), *extra,
                       port=ports[i], threads=threads, env=env, preexec=preexec)


def seed_identity(home: Path, node_id: str) -> None:
    """Make the next node started alone in `home` take `node_id` (exo_like/cluster/identity.py's slot 0)."""
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


class LateRelay:
    """A loopback port that reaches a node only once opened, for another node's --peers: an address the node does
    not advertise, like a bootstrap address across a VPN or NAT.

    Until `open()` it accepts connections and holds them unanswered (a dial waits), closing each after HOLD_SECONDS
    (the dial fails and the dialer retries). `open()` forwards the connections it holds and every later one, so a
    node whose dial is waiting links at that moment: a test can start the node in advance (its start takes
    seconds), wait for its dial (`wait_for_dial`), and make it join at an exact point, e.g. mid-stream."""

    HOLD_SECONDS = 4.0

    def __init__(self, target_port: int):
        self.target_port = target_port
        self._listener = socket.create_server(("127.0.0.1", 0))
        self._listener.settimeout(0.1)
        self.port = self._listener.getsockname()[1]
        self._held: list[tuple[socket.socket, float]] = []
        self._accepted = threading.Condition()
        self._dials = 0
        self._opened = threading.Event()
        self._closed = threading.Event()
        self._threads = [threading.Thread(target=self._accept_forever, daemon=True)]
        self._threads[0].start()

    def wait_for_dial(self, timeout: float = 30) -> None:
        """Return once a dial made after this call is waiting here."""
        with self._accepted:
            seen = self._dials
            if not self._accepted.wait_for(lambda: self._dials > seen, timeout):
                raise AssertionError(f"nothing dialed the relay on port {self.port} within {timeout}s")

    def open(self) -> None:
        with self._accepted:
            self._opened.set()
            held, self._held = self._held, []
        for connection, _ in held:
            self._forward_in_thread(connection)

    def close(self) -> None:
        self._closed.set()
        for thread in self._threads:
            thread.join(5)
        with self._accepted:
            for connection, _ in self._held:
                connection.close()

    def _accept_forever(self) -> None:
        with self._listener:
            while not self._closed.is_set():
                self._drop_expired()
                try:
                    connection, _ = self._listener.accept()
                except TimeoutError:
                    continue
                with self._accepted:
                    if not self._opened.is_set():
                        self._held.append((connection, time.monotonic()))
                        self._dials += 1
                        self._accepted.notify_all()
                        continue
                self._forward_in_thread(connection)

    def _drop_expired(self) -> None:
        with self._accepted:
            expired = [c for c, since in self._held if time.monotonic() - since > self.HOLD_SECONDS]
            self._held = [(c, since) for c, since in self._held if c not in expired]
        for connection in expired:
            connection.close()

    def _forward_in_thread(self, connection: socket.socket) -> None:
        thread = threading.Thread(target=self._forward, args=(connection,), daemon=True)
        self._threads.append(thread)
        thread.start()

    def _forward(self, connection: socket.socket) -> None:
        with connection, socket.create_connection(("127.0.0.1", self.target_port)) as upstream:
            while not self._closed.is_set():
                readable, _, _ = select.select([connection, upstream], [], [], 0.2)
                for source in readable:
                    try:
                        data = source.recv(65536)
                        if data:
                            (upstream if source is connection else connection).sendall(data)
                    except OSError:  # one side reset the connection (a node killed)
                        data = b""
                    if not data:
                        return
