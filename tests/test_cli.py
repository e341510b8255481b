"""The `exo-like` command: starts with the demo model, answers curl, logs with its node id, shuts down cleanly."""

from __future__ import annotations

import http.client
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from exo_like.api.routes import SHUTDOWN_GRACE
from tests.api_server import NodeProcess, exo_like_command, start_node, wait_for


@pytest.fixture(scope="module")
def demo_home(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One home for the module's nodes, so the demo model is generated once."""
    return tmp_path_factory.mktemp("home")


@pytest.fixture(scope="module")
def demo_node(demo_home: Path):  # type: ignore[no-untyped-def]
    """Shared by the tests that ask it; the last of them (test_sigint_shuts_down_gracefully) stops it."""
    process = start_node(demo_home, "demo")
    yield process
    assert process.stop() == 0, process.log()  # (at once when that test has stopped it: its exit code)


def curl(url: str, *args: str) -> tuple[int, str]:
    """The request as a user would type it; falls back to urllib where curl is missing."""
    if shutil.which("curl"):
        out = subprocess.run(["curl", "-s", "-w", "\n%{http_code}", *args, url], capture_output=True, text=True,
                             timeout=60, check=True).stdout
        body, _, status = out.rpartition("\n")
        return int(status), body
    import urllib.error
    import urllib.request

    data = args[args.index("-d") + 1].encode() if "-d" in args else None
    try:
        with urllib.request.urlopen(urllib.request.Request(url, data=data), timeout=60) as response:
            return response.status, response.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode()


def test_demo_node_answers_a_curl_chat_request(demo_node: NodeProcess) -> None:
    request = {"model": "demo", "messages": [{"role": "user", "content": "Hello!"}], "max_tokens": 8}
    status, body = curl(f"{demo_node.base_url}/v1/chat/completions", "-H", "Content-Type: application/json",
                        "-d", json.dumps(request))
    assert status == 200, body
    response = json.loads(body)
    assert response["model"] == "demo" and response["object"] == "chat.completion"
    assert response["choices"][0]["message"]["role"] == "assistant"
    assert isinstance(response["choices"][0]["message"]["content"], str)
    assert response["usage"]["completion_tokens"] >= 1


def test_demo_node_streams_to_curl_without_content_type(demo_node: NodeProcess) -> None:
    request = {"model": "demo", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4, "stream": True}
    status, body = curl(f"{demo_node.base_url}/v1/chat/completions", "-N", "-d", json.dumps(request))
    assert status == 200, body
    events = [line for line in body.splitlines() if line.startswith("data: ")]
    assert events[-1] == "data: [DONE]"
    first = json.loads(events[0][len("data: "):])
    assert first["object"] == "chat.completion.chunk" and first["choices"][0]["delta"]["role"] == "assistant"


def test_models_health_and_index(demo_node: NodeProcess) -> None:
    assert wait_for(lambda: demo_node.get_json("/v1/models")["data"][0]["state"] == "serving", timeout=60)
    models = demo_node.get_json("/v1/models")["data"]
    assert models[0]["id"] == "demo"  # the served model first, "serving" once loaded
    assert [m["id"] for m in models].count("demo") == 1  # not listed again as a local folder
    assert {m["id"]: m["state"] for m in models if m["source"] == "catalog"}["llama-3.2-1b"] == "not_downloaded"
    health = demo_node.get_json("/health")
    assert health["status"] == "ok" and health["model"] == "demo" and health["engine"] in ("torch", "mlx")
    assert demo_node.get_json("/")["node_id"] == health["node_id"]


def test_log_lines_carry_the_node_id(demo_node: NodeProcess) -> None:
    node_id = demo_node.get_json("/health")["node_id"]
    lines = [line for line in demo_node.log().splitlines() if line.strip()]
    assert lines and all(f"[{node_id}]" in line for line in lines if line[:4].isdigit())
    assert any("serving the OpenAI API" in line for line in lines)


def test_sigint_shuts_down_gracefully(demo_node: NodeProcess) -> None:
    """On the shared node, after the other tests that ask it (a node started for this alone would cost a start)."""
    process = demo_node
    assert process.stop(signal.SIGINT) == 0, process.log()
    assert "shutting down" in process.log() and "node stopped" in process.log()
    assert "Traceback" not in process.log()


def run_cli(*args: str, timeout: float = 120,  # type: ignore[type-arg]
            env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([*exo_like_command(), *args], capture_output=True, text=True, timeout=timeout, env=env)


def test_unknown_model_exits_with_a_clear_message(tmp_path: Path) -> None:
    result = run_cli("--model", str(tmp_path / "missing"), "--home", str(tmp_path), "--port", "0")
    assert result.returncode == 1
    assert "not found" in result.stderr and "Traceback" not in result.stderr


def test_port_in_use_exits_with_a_clear_message_and_home_comes_from_the_environment(tmp_path: Path) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        result = run_cli("--model", "demo", "--host", "127.0.0.1", "--port", str(port),
                         env={**os.environ, "EXO_LIKE_HOME": str(tmp_path)})
    assert result.returncode == 1
    assert f"cannot serve on 127.0.0.1:{port}" in result.stderr and "Traceback" not in result.stderr
    assert (tmp_path / "models" / "demo" / "config.json").is_file()  # EXO_LIKE_HOME was used


def test_python_dash_m_shows_the_options() -> None:
    result = subprocess.run([sys.executable, "-m", "exo_like", "--help"], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0
    for option in ("--port", "--host", "--home", "--model", "--engine", "--device", "--dtype", "--log-level"):
        assert option in result.stdout


@pytest.mark.skipif(shutil.which("curl") is None, reason="needs curl")
def test_shutdown_lets_short_requests_finish_and_ends_long_streams_cleanly(demo_home: Path) -> None:
    """SIGTERM: a request that finishes within the grace period completes; a stream that would not gets an
    in-band 'shutting down' error and [DONE]; a new request on a connection still open is refused with a 503
    (shutting_down) rather than started; the process exits 0."""
    process = start_node(demo_home, "demo")
    long_body = json.dumps({"model": "demo", "messages": [{"role": "user", "content": "Go on."}], "stream": True,
                            "max_tokens": 4000, "ignore_eos": True})
    long_request = subprocess.Popen(["curl", "-sN", "-d", long_body, f"{process.base_url}/v1/chat/completions"],
                                    stdout=subprocess.PIPE, text=True)
    short_body = json.dumps({"model": "demo", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 100,
                             "ignore_eos": True}).encode()
    kept_alive = http.client.HTTPConnection("127.0.0.1", process.port, timeout=30)
    kept_alive.request("GET", "/health")
    assert kept_alive.getresponse().read()
    with ThreadPoolExecutor(1) as pool:
        short = pool.submit(process.request, "POST", "/v1/chat/completions", short_body)
        assert wait_for(lambda: len(process.get_json("/v1/debug/requests")["requests"]) == 2)
        started = time.monotonic()
        process.process.send_signal(signal.SIGTERM)
        assert wait_for(lambda: "shutting down" in process.log())
        kept_alive.request("POST", "/v1/chat/completions", short_body, {"Content-Type": "application/json"})
        refused = kept_alive.getresponse()
        assert refused.status == 503 and json.loads(refused.read())["error"]["code"] == "shutting_down"
        status, _, raw = short.result(timeout=60)
    assert status == 200 and json.loads(raw)["choices"][0]["finish_reason"] == "length"
    out, _ = long_request.communicate(timeout=60)
    assert process.process.wait(timeout=60) == 0  # (the timeouts only guard against hanging)
    # The node gave the long stream its grace period, then ended it (below: in-band, rather than waiting for
    # its 4000 tokens); not timed against a clock a busy machine stretches, beyond that lower bound.
    assert time.monotonic() - started >= SHUTDOWN_GRACE
    events = [line[len("data: "):] for line in out.splitlines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    assert json.loads(events[-2])["error"]["code"] == "shutting_down"
    assert "the node is shutting down after" in process.log() and "Traceback" not in process.log()
