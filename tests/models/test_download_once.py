"""Download once per cluster: three nodes loading one model at once take each byte from the hub at most once (one
member fetches each file, the others read it from that member as it arrives; the description comes from the node
that resolved the name), and with the hub unreachable a model on one node's disk is served by nodes that never
held it, as transformers answers. The hub's log (tests/hub_server.py) counts the bytes."""

from __future__ import annotations

import shutil
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.api_server import stop_nodes, wait_for
from tests.checkpoints import make_checkpoint
from tests.cluster_harness import cluster_of, start_cluster, wait_until_ready
from tests.hub_server import HubServer
from tests.models.test_download import PROMPT, answer, hub_env
from tests.oracle import Oracle

SHARED = "test-org/shared"  # one model.safetensors: every stage needs the whole file


@pytest.fixture(scope="module")
def shared(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_checkpoint(tmp_path_factory.mktemp("ckpt") / "shared", "llama", n_layers=6, hidden_size=256,
                           intermediate_size=1024, max_shard_size="50MB")


@pytest.fixture(scope="module")
def hub(shared: Path) -> Iterator[HubServer]:
    server = HubServer()
    server.add_repo(SHARED, shared)
    # Slow enough that the three nodes' loads overlap: whoever is not fetching the file waits for it.
    server.throttle = (shared / "model.safetensors").stat().st_size / 3
    server.start()
    yield server
    server.stop()


def test_three_nodes_take_each_byte_from_the_hub_once_and_a_node_without_the_hub_loads_from_peers(
        hub: HubServer, shared: Path, tmp_path: Path) -> None:
    oracle = Oracle(shared)
    expected = oracle.expected(oracle.chat_ids(PROMPT), 16)[0]
    sizes = {name: file.size for name, file in hub.repos[SHARED].files.items()}
    nodes = start_cluster(tmp_path, None, [6, 3, 2], envs=[hub_env(hub.endpoint, f"node{i}", tmp_path)
                                                          for i in range(3)], extra=("--placement", "memory"))
    try:
        assert wait_for(lambda: all(len(cluster_of(node)["nodes"]) == 3 for node in nodes), timeout=30)
        assert answer(nodes[1], SHARED) == expected
        wait_until_ready(nodes, members=3, timeout=60)
        assert len(cluster_of(nodes[0])["plan"]["stages"]) == 3  # every node needs the whole file
        for i in range(3):
            assert (tmp_path / f"home{i}" / "hub" / "models--test-org--shared" / "snapshots" /
                    hub.repos[SHARED].commit / "model.safetensors").is_file()
        log = hub.requests()
        sent: Counter[str] = Counter()
        for served in log:
            if served.file is not None and served.method == "GET" and not served.bounded:
                sent[served.file] += served.bytes_sent
        assert sent["model.safetensors"] == sizes["model.safetensors"], sent
        assert all(sent[name] <= size for name, size in sizes.items()), (sent, sizes)
        # Only the node the request reached asked the hub about the repo; the others got the description from it.
        assert {r.origin for r in log if r.path.startswith("/api/models/")} == {"node1"}
        assert all(answer(node, SHARED) == expected for node in (nodes[0], nodes[2]))
    finally:
        stop_nodes(nodes)

    # No hub now; the model is on home0's disk only. A request reaching a node that never held it is served.
    before = len(hub.requests())
    unreachable = "http://127.0.0.1:9"  # the discard port: refused
    shutil.copytree(tmp_path / "home0" / "hub", tmp_path / "offline" / "home0" / "hub", symlinks=True)
    offline = start_cluster(tmp_path / "offline", None, [6, 3, 2], envs=[
        hub_env(unreachable, f"offline{i}", tmp_path) for i in range(3)], extra=("--placement", "memory"))
    try:
        assert wait_for(lambda: all(len(cluster_of(node)["nodes"]) == 3 for node in offline), timeout=30)
        assert answer(offline[2], SHARED) == expected
        assert answer(offline[1], SHARED) == expected
        assert len(hub.requests()) == before
    finally:
        stop_nodes(offline)
