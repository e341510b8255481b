"""Real nodes fetching a generated checkpoint from a loopback hub (tests/hub_server.py) through HF_ENDPOINT.

Shard-only downloads per node (from the hub's request log and each node's cache), greedy output equal to
transformers, a download cut mid-file that resumes on restart, offline mode with a warm and a cold cache, and
the clear errors: unknown repo, gated repo, unsupported architecture, no network, a request waiting on a
download. The oracle is transformers' greedy `generate` on the same checkpoint.
"""

from __future__ import annotations

import json
import os
import subprocess
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Iterator

import pytest

from exo_like.models.checkpoint import files_for_shard, weight_map
from exo_like.models.hub.download import WRITE_CHUNK
from exo_like.models.hub.peer_files import NODE_HEADER, PROOF_HEADER, file_path, proof
from exo_like.models.shard import Shard
from exo_like.node import DEFAULT_CLUSTER_KEY
from tests.api_server import NodeProcess, exo_like_command, launch_node, start_node, stop_nodes, wait_for
from tests.checkpoints import make_checkpoint
from tests.cluster_harness import cluster_of, free_ports, start_cluster, wait_until_ready
from tests.hub_server import HubServer
from tests.oracle import Oracle

REPO, GATED, UNSUPPORTED, MISSING = "test-org/llama7", "gated-org/llama7", "test-org/gpt-neox", "test-org/missing"
BIG = "test-org/big"  # files of several write chunks (WRITE_CHUNK), so a cut leaves a partial file
EVOLVING = "test-org/evolving"  # gets a second commit mid-test
PROMPT = "What is the capital of France?"
MAX_TOKENS = 16


@pytest.fixture(scope="module")
def llama7(tmp_path_factory: pytest.TempPathFactory) -> Path:
    # ~200 KB files: about one layer per file, so each stage needs a different subset.
    return make_checkpoint(tmp_path_factory.mktemp("ckpt") / "llama7", "llama", n_layers=7, max_shard_size="200KB")


@pytest.fixture(scope="module")
def oracle(llama7: Path) -> Oracle:
    return Oracle(llama7)


@pytest.fixture(scope="module")
def big(tmp_path_factory: pytest.TempPathFactory) -> Path:
    # One model.safetensors (no index): the single-file layout, which every stage needs whole.
    return make_checkpoint(tmp_path_factory.mktemp("ckpt") / "big", "llama", n_layers=2, hidden_size=256,
                           intermediate_size=1024, max_shard_size="50MB")


@pytest.fixture(scope="module")
def hub(llama7: Path, big: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[HubServer]:
    neox = tmp_path_factory.mktemp("neox")
    (neox / "config.json").write_text(json.dumps({"model_type": "gpt_neox", "architectures": ["GPTNeoXForCausalLM"],
                                                  "hidden_size": 64, "num_hidden_layers": 2}))
    server = HubServer()
    server.add_repo(REPO, llama7)
    server.add_repo(GATED, llama7, gated=True)
    server.add_repo(UNSUPPORTED, neox)
    server.add_repo(BIG, big)
    server.start()
    yield server
    server.stop()


def hub_env(endpoint: str, origin: str, root: Path, **more: str) -> dict[str, str | None]:
    """The node's environment: this hub, a tag that names the node in the hub's log, no token or cache from the
    machine (HF_HOME isolates a token file, too)."""
    return {"HF_ENDPOINT": endpoint, "HF_HUB_USER_AGENT_ORIGIN": origin, "HF_HOME": str(root / f"hf-home-{origin}"),
            "HF_TOKEN": None, "HF_HUB_OFFLINE": None, "HF_HUB_CACHE": None, **more}


def chat(node: NodeProcess, model: str) -> tuple[int, dict[str, Any]]:
    body = json.dumps({"model": model, "messages": [{"role": "user", "content": PROMPT}],
                       "max_tokens": MAX_TOKENS, "temperature": 0}).encode()
    status, _, raw = node.request("POST", "/v1/chat/completions", body, {"Content-Type": "application/json"})
    return status, json.loads(raw)


def answer(node: NodeProcess, model: str) -> str:
    status, body = chat(node, model)
    assert status == 200, body
    return body["choices"][0]["message"]["content"]


def expected_text(oracle: Oracle) -> str:
    return oracle.expected(oracle.chat_ids(PROMPT), MAX_TOKENS)[0]


def snapshot(home: Path, hub: HubServer) -> Path:
    return home / "hub" / "models--test-org--llama7" / "snapshots" / hub.repos[REPO].commit


def stop_cleanly(nodes: list[NodeProcess]) -> None:
    for node, code in zip(nodes, stop_nodes(nodes)):
        assert code == 0, node.log()
        assert "Traceback" not in node.log(), node.log()


def test_three_nodes_each_fetch_only_their_layers_files_and_match_transformers(hub: HubServer, llama7: Path,
                                                                              oracle: Oracle, tmp_path: Path) -> None:
    envs = [hub_env(hub.endpoint, f"node{i}", tmp_path) for i in range(3)]
    # No --model: the nodes first find each other, then the first request chooses the model, so every node plans
    # (and downloads) for the three-node ring from the start.
    nodes = start_cluster(tmp_path, None, [6, 3, 1], envs=envs,
                          extra=("--placement", "memory"))  # each a share of the layers, whatever their speeds
    try:
        assert wait_for(lambda: all(len(cluster_of(node)["nodes"]) == 3 for node in nodes), timeout=30)
        expected = expected_text(oracle)
        assert answer(nodes[1], REPO) == expected
        wait_until_ready(nodes, members=3, timeout=60)
        view = cluster_of(nodes[0])
        stages = {s["node_id"]: Shard(REPO, s["start_layer"], s["end_layer"], 7) for s in view["plan"]["stages"]}
        weights, sizes = weight_map(llama7), {p.name: p.stat().st_size for p in llama7.glob("*.safetensors")}
        from_hub: list[str] = []
        for i, node in enumerate(nodes):
            node_id = cluster_of(node)["node_id"]
            needed = files_for_shard(weights, stages[node_id], tied_embeddings=False)
            assert 0 < len(needed) < len(sizes)  # a real subset: fetching everything would fail this test
            fetched = hub.weight_downloads(f"node{i}")
            # Each needed file at most once, nothing else; one another member fetches came from that member.
            assert len({r.file for r in fetched}) == len(fetched) and {r.file for r in fetched} <= needed
            assert all(r.range_start is None and r.bytes_sent == sizes[r.file] for r in fetched)
            assert {p.name for p in snapshot(tmp_path / f"home{i}", hub).glob("*.safetensors")} == needed
            from_hub += [r.file for r in fetched]
            download = next(n for n in view["nodes"] if n["id"] == node_id)["download"]
            assert download["state"] == "complete" and download["files_total"] == len(needed)
            assert download["done_bytes"] == download["total_bytes"] == sum(sizes[f] for f in needed)
        # The hub saw each file the plan needs exactly once, whichever nodes share it.
        assert sorted(from_hub) == sorted(set().union(*(files_for_shard(weights, shard, False)
                                                        for shard in stages.values())))
        for node in (nodes[0], nodes[2]):
            assert answer(node, REPO) == expected
        models = nodes[0].get_json("/v1/models")["data"]
        assert (models[0]["id"], models[0]["state"], models[0]["source"]) == (REPO, "serving", "hub")
        assert {m["id"]: m["state"] for m in models}["qwen2.5-0.5b"] == "not_downloaded"
    finally:
        stop_cleanly(nodes)


@pytest.mark.slow
def test_cut_download_resumes_on_restart_and_the_warm_cache_serves_offline(hub: HubServer, big: Path,
                                                                           tmp_path: Path) -> None:
    name = max(hub.repos[BIG].files.values(), key=lambda f: f.size).path.name
    size, sha256 = hub.repos[BIG].files[name].size, hub.repos[BIG].files[name].sha256
    # The node writes whole WRITE_CHUNK pieces: cut after several, so a good part of the file is on disk.
    assert size > 4 * WRITE_CHUNK
    cut_at = size // 2 + 12345
    env = hub_env(hub.endpoint, "resume", tmp_path)
    args = ("--no-mdns", "--dtype", "float32")

    hub.cut(BIG, name, cut_at)
    # transformers' answer, computed while the first node starts (the test process waits on it meanwhile)
    with ThreadPoolExecutor(1) as pool:
        expected_answer = pool.submit(lambda: expected_text(Oracle(big)))
        try:
            node = start_node(tmp_path, BIG, *args, env=env)
            problem = wait_for(lambda: cluster_of(node)["problem"], timeout=60)
            assert problem and name in problem and "503" in problem, problem
            stop_cleanly([node])
        finally:
            hub.uncut()
    expected = expected_answer.result()
    first = [r for r in hub.weight_downloads("resume") if r.file == name]
    assert [(r.range_start, r.bytes_sent) for r in first] == [(None, cut_at)]  # the cut transfer
    part = tmp_path / "hub" / "models--test-org--big" / "blobs" / f"{sha256}.part"
    kept = part.stat().st_size
    assert 0 < kept <= cut_at

    seen = len(hub.requests())
    node = start_node(tmp_path, BIG, *args, env=env)
    try:
        wait_until_ready([node], members=1, timeout=60)
        resumed = hub.weight_downloads("resume", since=seen)
        assert [(r.file, r.range_start, r.bytes_sent) for r in resumed] == [(name, kept, size - kept)]
        snapshot = tmp_path / "hub" / "models--test-org--big" / "snapshots" / hub.repos[BIG].commit
        assert not part.exists() and (snapshot / name).read_bytes() == (big / name).read_bytes()
        assert answer(node, BIG) == expected
    finally:
        stop_cleanly([node])

    seen = len(hub.requests())
    node = start_node(tmp_path, BIG, *args, env={**env, "HF_HUB_OFFLINE": "1"})
    try:
        wait_until_ready([node], members=1, timeout=60)
        assert answer(node, BIG) == expected
        assert hub.requests(since=seen) == []  # offline means offline
    finally:
        stop_cleanly([node])


def test_a_node_that_joins_after_a_new_commit_fetches_the_commit_the_cluster_serves(
        hub: HubServer, llama7: Path, oracle: Oracle, tmp_path: Path) -> None:
    # Mixed weights would be silent: each node would plan and answer without error, the tokens would be wrong.
    first = hub.add_repo(EVOLVING, llama7)
    expected = expected_text(oracle)

    def retrain() -> tuple[Path, str]:
        retrained = make_checkpoint(tmp_path / "retrained", "llama", n_layers=7, max_shard_size="200KB", seed=1)
        return retrained, expected_text(Oracle(retrained))

    ports = free_ports(2)
    # --placement memory: the two stages asserted below follow from the memory set here, not from measured speeds
    common = ("--no-mdns", "--dtype", "float32", "--memory-gb", "4", "--placement", "memory")
    with ThreadPoolExecutor(1) as pool:  # the second commit made while the first node starts
        second_commit = pool.submit(retrain)
        nodes = [start_node(tmp_path / "home0", EVOLVING, *common, "--node-name", "first", port=ports[0],
                            env=hub_env(hub.endpoint, "first", tmp_path))]
    try:
        retrained, retrained_text = second_commit.result()
        assert retrained_text != expected  # else this test could not tell the commits apart
        wait_until_ready(nodes, members=1, timeout=60)
        pinned = f"{EVOLVING}@{first.commit}"
        assert cluster_of(nodes[0])["plan"]["model"] == pinned
        second = hub.add_repo(EVOLVING, retrained)  # pushed while the cluster runs
        assert second.commit != first.commit
        nodes.append(start_node(tmp_path / "home1", None, *common, "--node-name", "joiner", "--peers",
                                f"127.0.0.1:{ports[0]}", port=ports[1], env=hub_env(hub.endpoint, "joiner", tmp_path)))
        wait_until_ready(nodes, members=2, timeout=60)
        for node in nodes:
            view = cluster_of(node)
            assert view["plan"]["model"] == pinned and len(view["plan"]["stages"]) == 2, view
            assert answer(node, EVOLVING) == expected
        joiner_cache = tmp_path / "home1" / "hub" / "models--test-org--evolving" / "snapshots"
        assert [p.name for p in joiner_cache.iterdir()] == [first.commit]
        # Every weight file the joiner needs came from the first node, which holds them all: none from the hub.
        assert hub.weight_downloads("joiner") == []
        assert "fetched from peer" in nodes[1].log()
        served = nodes[1].get_json("/v1/models")["data"][0]
        assert (served["id"], served["repo"], served["revision"]) == (EVOLVING, EVOLVING, first.commit)
        # A revision of the served repo is answered on every node when it names the served commit (say, the
        # first node was started with it); one naming another commit names another model, served beside it.
        hub.tag(EVOLVING, "v1", first.commit)
        hub.tag(EVOLVING, "v2", second.commit)
        assert answer(nodes[1], f"{EVOLVING}@v1") == expected
        for revision in ("v2", "main"):
            assert answer(nodes[1], f"{EVOLVING}@{revision}") == retrained_text
        models = [instance["model"] for instance in cluster_of(nodes[0])["instances"]]
        assert models == [pinned, f"{EVOLVING}@{second.commit}"], models
    finally:
        stop_cleanly(nodes)


def test_offline_or_no_downloads_with_a_cold_cache_fails_clearly(hub: HubServer, tmp_path: Path) -> None:
    """HF_HUB_OFFLINE=1 at start with --model; --no-downloads (hub reachable) when a request names the model: each
    a clear error in its own words, and the second node never asks the hub anything."""
    env = hub_env(hub.endpoint, "cold", tmp_path, HF_HUB_OFFLINE="1")
    process_env = {k: v for k, v in {**os.environ, **env}.items() if v is not None}
    launched = launch_node(tmp_path / "b", None, "--no-mdns", "--no-downloads",  # no --model: a request asks
                           env=hub_env(hub.endpoint, "no-downloads", tmp_path))
    try:  # (the node starts meanwhile)
        started = subprocess.run([*exo_like_command(), "--model", REPO, "--home", str(tmp_path / "a"), "--port",
                                  "0", "--host", "127.0.0.1", "--no-mdns"], env=process_env, capture_output=True,
                                 text=True, timeout=120)
        assert started.returncode == 1, started.stderr
        assert "HF_HUB_OFFLINE is set" in started.stderr and "does not hold" in started.stderr, started.stderr
        assert "Traceback" not in started.stderr
        node = launched.serving()
    except BaseException:
        launched.stop()
        raise
    try:
        status, body = chat(node, REPO)
        assert status == 503 and body["error"]["code"] == "model_not_cached", body
        assert "runs with --no-downloads" in body["error"]["message"] and REPO in body["error"]["message"]
        assert node.get_json("/health")["status"] == "ok"
        assert hub.requests(origin="no-downloads") == []
    finally:
        stop_cleanly([node])


def test_hub_errors_are_clear_and_the_node_keeps_serving(hub: HubServer, tmp_path: Path) -> None:
    node = start_node(tmp_path, None, "--no-mdns", "--dtype", "float32", "--request-wait", "3",
                      env=hub_env(hub.endpoint, "errors", tmp_path))
    try:
        for model, status, code, words in [
            (MISSING, 404, "model_not_found", "was not found on"),
            (f"{REPO}@no-such-branch", 404, "model_not_found", "has no revision 'no-such-branch'"),
            (GATED, 401, "gated_model", "HF_TOKEN"),
            (UNSUPPORTED, 400, "unsupported_architecture", "gpt_neox"),
        ]:
            got, body = chat(node, model)
            assert (got, body["error"]["code"]) == (status, code), body
            assert model.partition("@")[0] in body["error"]["message"] and words in body["error"]["message"], body
            assert body["error"]["message"] in node.log()  # and in the node's log
        # A request that has to wait for the download says what it waits for (and that the load goes on).
        hub.throttle = 100_000  # per transfer: the 1.5 MB take several seconds, longer than --request-wait
        request = json.dumps({"model": REPO, "messages": [{"role": "user", "content": PROMPT}], "max_tokens": 4})
        got, headers, raw = node.request("POST", "/v1/chat/completions", request.encode(),
                                         {"Content-Type": "application/json"})
        body = json.loads(raw)
        assert got == 503 and body["error"]["code"] == "model_loading", body
        assert int(headers["Retry-After"]) > 0, headers
        message = body["error"]["message"]
        assert f"{REPO} layers [0, 7): downloading" in message and "% (" in message and "files" in message, message
        assert node.get_json("/health")["status"] == "ok"
    finally:
        hub.throttle = None
        stop_cleanly([node])


def test_no_network_is_a_clear_503(tmp_path: Path) -> None:
    closed = f"http://127.0.0.1:{free_ports(1)[0]}"  # nothing listens here
    node = start_node(tmp_path, None, "--no-mdns", env=hub_env(closed, "offline", tmp_path))
    try:
        status, body = chat(node, REPO)
        assert status == 503 and body["error"]["code"] == "hub_unreachable", body
        message = body["error"]["message"]
        assert f"cannot reach the hub at {closed}" in message and "does not hold" in message, message
        assert node.get_json("/health")["status"] == "ok"
    finally:
        stop_cleanly([node])


def test_a_model_is_pulled_loaded_and_unloaded_by_the_api_then_deleted(hub: HubServer, llama7: Path,
                                                                       oracle: Oracle, tmp_path: Path) -> None:
    """Ollama's pull (its progress lines) and delete, and this project's load API, on one node started without a
    model: the pull fetches every weight file once, the load that follows fetches nothing more."""
    import ollama

    node = start_node(tmp_path / "home", None, "--no-mdns", "--dtype", "float32",
                      env=hub_env(hub.endpoint, "puller", tmp_path))
    try:
        client = ollama.Client(host=node.base_url)
        statuses = [progress.status for progress in client.pull(REPO, stream=True)]
        assert statuses[0] == "pulling manifest" and statuses[-3:] == ["verifying sha256 digest", "writing manifest",
                                                                        "success"], statuses
        files = {name for name in hub.repos[REPO].files if name.endswith(".safetensors")}
        assert {r.path.removeprefix("/cdn/") for r in hub.weight_downloads("puller")} == \
            {hub.repos[REPO].files[name].sha256 for name in files}
        assert {m["id"]: m["state"] for m in node.get_json("/v1/models")["data"]}[REPO] == "downloaded"
        fetched = len(hub.weight_downloads("puller"))

        # What it holds whole it serves to peers that prove the cluster key (the default key here), with Range.
        name = sorted(files)[0]
        path = file_path(REPO, hub.repos[REPO].commit, name)
        status, _, _ = node.request("GET", path, None, {NODE_HEADER: "x", PROOF_HEADER: "0" * 64})
        assert status == 403
        proved = {NODE_HEADER: "x", PROOF_HEADER: proof(DEFAULT_CLUSTER_KEY, "x", path)}
        status, _, body = node.request("GET", path, None, proved)
        assert status == 200 and body == (llama7 / name).read_bytes()
        status, _, body = node.request("GET", path, None, {**proved, "Range": "bytes=10-19"})
        assert status == 206 and body == (llama7 / name).read_bytes()[10:20]
        elsewhere = file_path(REPO, hub.repos[REPO].commit, "../../x")
        status, _, _ = node.request("GET", elsewhere, None, {NODE_HEADER: "x",
                                                            PROOF_HEADER: proof(DEFAULT_CLUSTER_KEY, "x", elsewhere)})
        assert status == 404

        headers = {"Content-Type": "application/json"}
        status, _, raw = node.request("POST", "/v1/instances", json.dumps({"model": REPO}).encode(), headers)
        assert status == 202, raw
        status, _, raw = node.request("POST", "/v1/instances", json.dumps({"model": REPO, "nodes": ["x"]}).encode(),
                                      headers)
        assert status == 400 and b"no member of the cluster has the id x" in raw, raw
        assert wait_for(lambda: [i["ready"] for i in node.get_json("/v1/instances")["data"]] == [True], timeout=60)
        assert answer(node, REPO) == expected_text(oracle)
        assert len(hub.weight_downloads("puller")) == fetched  # loaded from what the pull fetched
        status, _, raw = node.request("DELETE", f"/v1/instances/{REPO}")
        assert status == 200 and node.get_json("/v1/instances")["data"] == [], raw
        status, _, raw = node.request("DELETE", f"/v1/instances/{REPO}")
        assert status == 404 and b"is not loaded" in raw, raw

        client.delete(REPO)
        assert {m["id"]: m["state"] for m in node.get_json("/v1/models")["data"]}.get(REPO) is None
        with pytest.raises(ollama.ResponseError) as missing:
            client.delete(REPO)
        assert missing.value.status_code == 404 and "has no files in this node's cache" in missing.value.error
    finally:
        stop_cleanly([node])
