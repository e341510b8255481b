"""Separate hosts (network namespaces on a private bridge): nodes started with no peer flags find each other over
real mDNS multicast, agree on a plan, and serve requests sent to their own addresses. Nodes with another cluster
key on the same bridge stay apart. Traffic stays on these namespaces; the namespaces are always removed.
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from tests.api_server import exo_like_command
from tests.checkpoints import make_checkpoint
from tests.netns import NetnsHost, netns_hosts, requires_netns
from tests.oracle import Oracle

pytestmark = [requires_netns, pytest.mark.netns]

PORT = 52415
PROMPT = "Hello!"

# Runs inside a namespace: polls the local node until its cluster view is agreed over `members` nodes.
POLLER = textwrap.dedent("""
    import json, sys, time, urllib.request
    members, deadline = int(sys.argv[1]), time.time() + float(sys.argv[2])
    while time.time() < deadline:
        try:
            view = json.load(urllib.request.urlopen("http://127.0.0.1:%d/v1/cluster", timeout=2))
            if view["agreed"] and len(view["nodes"]) == members:
                print(json.dumps({"agreed_at": time.time(), "view": view}))
                sys.exit(0)
        except OSError:
            pass
        time.sleep(0.05)
    print(json.dumps({"agreed_at": None, "view": view}))
""" % PORT)

# Runs inside a namespace: one greedy chat request to a node's own address.
CHAT = textwrap.dedent("""
    import json, sys, urllib.request
    body = json.dumps({"model": sys.argv[2], "messages": [{"role": "user", "content": sys.argv[3]}],
                       "max_tokens": 16, "temperature": 0}).encode()
    request = urllib.request.Request(sys.argv[1] + "/v1/chat/completions", body, {"Content-Type": "application/json"})
    print(json.load(urllib.request.urlopen(request, timeout=120))["choices"][0]["message"]["content"])
""")


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_checkpoint(tmp_path_factory.mktemp("ckpt") / "llama5", "llama", n_layers=5)


def start_in(host: NetnsHost, home: Path, model: Path, *extra: str) -> tuple[subprocess.Popen, Path]:
    home.mkdir(parents=True, exist_ok=True)
    log_path = home / "node.log"
    with open(log_path, "wb") as log_file:
        process = subprocess.Popen(host.command(*exo_like_command(), "--model", str(model), "--home", str(home),
                                                "--node-name", host.namespace, "--engine", "torch", "--dtype",
                                                "float32", *extra),
                                   stdout=log_file, stderr=subprocess.STDOUT, env={"OMP_NUM_THREADS": "1",
                                                                                  "PATH": "/usr/bin:/bin"})
    return process, log_path


def wait_serving(log_paths: list[Path], timeout: float = 90) -> float:
    """Wall-clock time at which the last node started serving."""
    deadline = time.time() + timeout
    pending = set(log_paths)
    while pending and time.time() < deadline:
        pending = {p for p in pending if "serving the OpenAI API" not in p.read_text(errors="replace")}
        time.sleep(0.05)
    assert not pending, [p.read_text() for p in pending]
    return time.time()


def run_in(host: NetnsHost, script: Path, *args: str, timeout: float = 120) -> str:
    result = subprocess.run(host.command(sys.executable, str(script), *args), capture_output=True, text=True,
                            timeout=timeout)
    assert result.returncode == 0, result.stderr
    return result.stdout.strip()


def test_nodes_find_each_other_over_mdns_agree_within_5s_and_serve(checkpoint: Path, tmp_path: Path) -> None:
    (tmp_path / "poll.py").write_text(POLLER)
    (tmp_path / "chat.py").write_text(CHAT)
    with netns_hosts(3) as hosts:
        launched = time.time()
        nodes = [start_in(h, tmp_path / f"home{i}", checkpoint, "--memory-gb", str(m))
                 for i, (h, m) in enumerate(zip(hosts, [4, 2, 1]))]
        try:
            all_serving = wait_serving([log for _, log in nodes])
            polls = [json.loads(run_in(h, tmp_path / "poll.py", "3", "20")) for h in hosts]
            assert all(p["agreed_at"] for p in polls), polls
            seconds = max(p["agreed_at"] for p in polls) - all_serving
            # 5 s on a quiet machine; on a loaded one, no longer than the nodes took to start (the same kind of
            # work: imports, loading a shard), so the check does not depend on how busy the machine is.
            allowed = max(5.0, all_serving - launched)
            print(f"mDNS discovery + plan agreement took {seconds:.2f}s after the last node started serving "
                  f"(allowed {allowed:.2f}s)")
            assert seconds <= allowed
            assert sorted(n["address"] for n in polls[0]["view"]["nodes"]) == sorted(
                f"{h.address}:{PORT}" for h in hosts)
            oracle = Oracle(checkpoint)
            expected = oracle.expected(oracle.chat_ids(PROMPT), 16)[0]
            for i, target in enumerate(hosts):  # each request sent from another host to the node's address
                sender = hosts[(i + 1) % len(hosts)]
                assert run_in(sender, tmp_path / "chat.py", f"http://{target.address}:{PORT}", checkpoint.name,
                              PROMPT) == expected.strip()
        finally:
            for process, _ in nodes:
                process.kill()
                process.wait()


def test_different_cluster_keys_do_not_link_and_the_refusal_is_logged(checkpoint: Path, tmp_path: Path) -> None:
    (tmp_path / "poll.py").write_text(POLLER)
    with netns_hosts(2, subnet="10.231.78") as hosts:
        nodes = [start_in(h, tmp_path / f"home{i}", checkpoint, "--cluster-key", key)
                 for i, (h, key) in enumerate(zip(hosts, ["key-one", "key-two"]))]
        try:
            wait_serving([log for _, log in nodes])
            time.sleep(6)  # longer than same-key nodes need to find each other
            views = [json.loads(run_in(h, tmp_path / "poll.py", "1", "5"))["view"] for h in hosts]
            assert [len(v["nodes"]) for v in views] == [1, 1]
            for _, log_path in nodes:
                assert "different cluster key" in log_path.read_text()
            # Each node names the other, and why they stay apart, in /v1/cluster (and so on its dashboard).
            for view, other_view, other_host in ((views[0], views[1], hosts[1]), (views[1], views[0], hosts[0])):
                [unlinked] = view["unlinked"]
                assert unlinked["node_id"] == other_view["node_id"] and unlinked["code"] == "other_cluster"
                assert unlinked["address"] == f"{other_host.address}:{PORT}"
                assert "different cluster key" in unlinked["reason"]
        finally:
            for process, _ in nodes:
                process.kill()
                process.wait()
