"""Real `exo-like` processes for the API tests: a test checkpoint, a node on a free port, its log.

Fixtures here are imported by the test modules that need them (`from tests.api_server import node`), so each
module gets its own node; the checkpoint is built once per test session.
"""

from __future__ import annotations

import http.client
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterator, Sequence

import pytest

from tests.checkpoints import make_checkpoint

ARCH = "qwen2"  # context 4096, tied embeddings, q/k/v bias
_LISTENING = re.compile(r"serving the OpenAI API on http://[^:]+:(\d+)/v1")


def exo_like_command() -> list[str]:
    script = Path(sys.executable).with_name("exo-like")
    return [str(script)] if script.exists() else [sys.executable, "-m", "exo_like"]


@dataclass
class NodeProcess:
    process: subprocess.Popen
    port: int
    log_path: Path

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def request(self, method: str, path: str, body: bytes | None = None,
                headers: dict[str, str] | None = None) -> tuple[int, dict[str, str], bytes]:
        """A raw HTTP request (stdlib only, so any method, header or body can be sent as is)."""
        connection = http.client.HTTPConnection("127.0.0.1", self.port, timeout=60)
        try:
            connection.request(method, path, body=body, headers=headers or {})
            response = connection.getresponse()
            return response.status, dict(response.getheaders()), response.read()
        finally:
            connection.close()

    def get_json(self, path: str) -> Any:
        status, _, body = self.request("GET", path)
        assert status == 200, body
        return json.loads(body)

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 20) -> int:
        self.signal(sig)
        return self.wait(timeout)

    def signal(self, sig: int) -> None:
        if self.process.poll() is None:
            self.process.send_signal(sig)

    def wait(self, timeout: float = 20) -> int:
        """The exit code, once the process ends (killed if it has not within `timeout` seconds)."""
        try:
            self.process.wait(timeout)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()
        return self.process.returncode


def stop_nodes(nodes: Sequence[NodeProcess], timeout: float = 20) -> list[int]:
    """Stop a test's nodes side by side (SIGTERM to all, then wait for each): stopped one by one, each later node
    would first re-plan and reload around the ones gone. Their exit codes, in order."""
    for node in nodes:
        node.signal(signal.SIGTERM)
    return [node.wait(timeout) for node in nodes]


def start_node(home: Path, model: str | None, *extra: str, timeout: float = 180, port: int = 0,
               threads: int = 1, env: dict[str, str | None] | None = None,
               preexec: Callable[[], None] | None = None) -> NodeProcess:
    """Start `exo-like` (on a free port by default) and wait until it reports its port and answers /health.

    `env` adds to (or, with None values, removes from) the environment the node inherits; `preexec` runs in the
    new process before exo-like does (e.g. joining a cgroup with a CPU quota, tests/cpu_quota.py)."""
    return launch_node(home, model, *extra, port=port, threads=threads, env=env, preexec=preexec).serving(timeout)


@dataclass
class Launched:
    """An `exo-like` process started, not yet known to serve."""

    process: subprocess.Popen
    log_path: Path

    def serving(self, timeout: float = 180) -> NodeProcess:
        """Wait until the process reports its port and answers /health (killed if it does not in time)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            match = _LISTENING.search(self.log_path.read_text(errors="replace"))
            if match:
                node = NodeProcess(self.process, int(match.group(1)), self.log_path)
                assert node.get_json("/health")["status"] == "ok"
                return node
            if self.process.poll() is not None:
                raise RuntimeError(f"exo-like exited with {self.process.returncode}:\n{self.log_path.read_text()}")
            time.sleep(0.1)
        self.stop()
        raise RuntimeError(f"exo-like did not start within {timeout}s:\n{self.log_path.read_text()}")

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.kill()
            self.process.wait()


def launch_node(home: Path, model: str | None, *extra: str, port: int = 0, threads: int = 1,
                env: dict[str, str | None] | None = None, preexec: Callable[[], None] | None = None) -> Launched:
    """Start `exo-like` in `home` (see start_node) without waiting for it."""
    home.mkdir(parents=True, exist_ok=True)
    fd, name = tempfile.mkstemp(prefix="node-", suffix=".log", dir=home)  # nodes may share a home
    os.close(fd)
    log_path = Path(name)
    command = [*exo_like_command(), *(["--model", model] if model else []), "--home", str(home),
               "--host", "127.0.0.1", "--port", str(port), *extra]
    # One torch thread: the test models are tiny, and on a small shared machine two threads that wait for each
    # other at every barrier stall for whole scheduler slices whenever another process holds a core.
    changes = {"OMP_NUM_THREADS": str(threads), **(env or {})}
    environment = {name: value for name, value in {**os.environ, **changes}.items() if value is not None}
    with open(log_path, "wb") as log_file:
        process = subprocess.Popen(command, stdout=log_file, stderr=subprocess.STDOUT, env=environment,
                                   preexec_fn=preexec)
    return Launched(process, log_path)


def wait_for(predicate, timeout: float = 15, interval: float = 0.05):  # type: ignore[no-untyped-def]
    """Poll until predicate() is truthy; return its last value (falsy on timeout)."""
    deadline = time.monotonic() + timeout
    value = predicate()
    while not value and time.monotonic() < deadline:
        time.sleep(interval)
        value = predicate()
    return value


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.getbasetemp() / f"api-checkpoint-{ARCH}"
    if not (path / "config.json").exists():
        make_checkpoint(path, ARCH, n_layers=2)
    return path


@pytest.fixture(scope="session")
def tools_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The API checkpoint with a chat template that renders tools (Hermes / Qwen2.5 style)."""
    from tests.chat_templates import HERMES_TOOLS_TEMPLATE

    path = tmp_path_factory.getbasetemp() / f"api-tools-checkpoint-{ARCH}"
    if not (path / "config.json").exists():
        make_checkpoint(path, ARCH, n_layers=2, chat_template=HERMES_TOOLS_TEMPLATE)
    return path


@pytest.fixture(scope="session")
def tools_node(tools_checkpoint: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[NodeProcess]:
    """A node serving tools_checkpoint (float32), shared by the dialect tests of a worker (they only ask it)."""
    yield from serving(tools_checkpoint, tmp_path_factory)


@pytest.fixture(scope="module")
def node(checkpoint: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[NodeProcess]:
    yield from serving(checkpoint, tmp_path_factory)


def serving(checkpoint: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[NodeProcess]:
    """A float32 node on `checkpoint` while the fixture lives; it must stop cleanly, with no traceback logged."""
    process = start_node(tmp_path_factory.mktemp("home"), str(checkpoint), "--dtype", "float32")
    yield process
    returncode = process.stop()
    assert returncode == 0, process.log()
    assert "Traceback" not in process.log(), process.log()
