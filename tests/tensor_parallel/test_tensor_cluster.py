"""Tensor-parallel groups in a real cluster: `exo-like --parallel tensor` nodes on loopback form one group of
workers over the model's layers; a request at any node answers the text one node alone gives. A rank's node
killed mid-stream (leader or follower): the survivors form a smaller group and the request replays to the same
text, and no worker outlives its node."""

from __future__ import annotations

import os
import signal
import threading
import time
from pathlib import Path

import psutil
import pytest

from tests.api_server import NodeProcess, start_node, stop_nodes
from tests.checkpoints import make_checkpoint
from tests.cluster.test_failover import check_against, stream
from tests.cluster_harness import cluster_of, start_cluster, wait_until_ready

PROMPT = "Tell me a story about a lighthouse."
TENSOR = ("--parallel", "tensor", "--placement", "memory")


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_checkpoint(tmp_path_factory.mktemp("ckpt") / "llama", "llama", n_layers=4)


def complete(node: NodeProcess, model: str, tokens: int = 48) -> str:
    import openai

    client = openai.OpenAI(base_url=node.base_url + "/v1", api_key="unused", max_retries=0, timeout=120)
    answer = client.chat.completions.create(model=model, max_tokens=tokens, temperature=0,
                                            extra_body={"ignore_eos": True},
                                            messages=[{"role": "user", "content": PROMPT}])
    return answer.choices[0].message.content


@pytest.fixture(scope="module")
def alone_text(model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> str:
    """What one node alone answers."""
    alone = start_node(tmp_path_factory.mktemp("alone"), str(model_dir), "--no-mdns", "--dtype", "float32")
    try:
        return complete(alone, str(model_dir))
    finally:
        stop_nodes([alone])


def worker_pids(node: NodeProcess) -> set[int]:
    return {child.pid for child in psutil.Process(node.process.pid).children(recursive=True)
            if "exo_like.tensor_parallel.worker" in " ".join(child.cmdline())}


@pytest.mark.parametrize("lost", [1, 0], ids=["follower", "leader"])
def test_a_rank_killed_mid_stream_costs_the_request_nothing(model_dir, alone_text, tmp_path, lost):
    nodes = start_cluster(tmp_path, str(model_dir), [4, 4, 4], extra=TENSOR)
    try:
        wait_until_ready(nodes, members=3, timeout=120)
        plan = cluster_of(nodes[0])["plan"]
        assert len(plan["stages"]) == 1 and len(plan["stages"][0]["group"]) == 3, plan
        for node in nodes:  # any node's API, the leader's and the followers': one node's text
            assert complete(node, str(model_dir)) == alone_text
        stage = plan["stages"][0]
        by_id = {node.get_json("/health")["node_id"]: node for node in nodes}
        victim = by_id[stage["group"][lost]]
        origin = next(node for node in nodes if node is not victim)
        workers = worker_pids(victim)
        assert len(workers) == 1
        reference = stream(origin, model_dir.name)
        reformed: list[float] = []  # seconds from the kill until /v1/cluster shows the smaller group

        def watch(killed: float) -> None:
            while time.monotonic() - killed < 30:
                plan = cluster_of(origin)["plan"]  # None for a moment while the group re-forms
                stages = plan["stages"] if plan else []
                if len(stages) == 1 and len(stages[0].get("group") or ()) == 2:
                    reformed.append(time.monotonic() - killed)
                    return
                time.sleep(0.05)

        watcher = threading.Thread(target=lambda: watch(time.monotonic()))

        def kill() -> None:
            victim.process.send_signal(signal.SIGKILL)
            watcher.start()
            victim.process.wait()

        got = stream(origin, model_dir.name, action=kill)
        watcher.join()
        check_against(reference, got, f"rank {lost} killed")
        print(f"the re-formed plan showed {reformed} s after the kill")
        assert reformed and reformed[0] <= 5.0
        survivors = [node for node in nodes if node is not victim]
        wait_until_ready(survivors, members=2, timeout=30)
        stages = cluster_of(origin)["plan"]["stages"]
        assert len(stages) == 1 and len(stages[0]["group"]) == 2, stages
        time.sleep(0.5)  # the kernel delivers the workers' death signal at once; let it be reaped
        assert not any(psutil.pid_exists(pid) and psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
                       for pid in workers), "the killed node's worker outlived it"
    finally:
        stop_nodes(nodes)
    assert not any(worker_pids(node) for node in nodes if node.process.poll() is None)


def test_a_worker_that_dies_under_a_live_node_is_replaced(model_dir, tmp_path):
    """The follower's worker killed in one stream, the leader's in the next: each time every member starts anew
    under the same plan and the request replays to the same text."""
    nodes = start_cluster(tmp_path, str(model_dir), [4, 4], extra=TENSOR)
    try:
        wait_until_ready(nodes, members=2, timeout=120)
        before = cluster_of(nodes[0])["plan"]
        by_id = {node.get_json("/health")["node_id"]: node for node in nodes}
        reference = stream(nodes[0], model_dir.name)
        for rank in (1, 0):
            host = by_id[before["stages"][0]["group"][rank]]
            (worker,) = worker_pids(host)
            got = stream(nodes[0], model_dir.name, action=lambda: os.kill(worker, signal.SIGKILL))
            check_against(reference, got, f"rank {rank}'s worker killed")
            assert cluster_of(nodes[0])["plan"]["digest"] == before["digest"]  # the same plan, a new worker
            assert len(worker_pids(host)) == 1 and worker not in worker_pids(host)
    finally:
        stop_nodes(nodes)
