"""Placement by speed on real nodes: three nodes of equal --memory-gb on one host, one of them held to a quarter of
a core by a cgroup CPU quota (made here, removed afterwards), get the layers by measured speed: the slow node measures
slower, the plan is the one partitioning/ computes from the figures the nodes announce, and the ring's greedy output
is still transformers'. And the measurement: timed over its windows, read from the cache in <home> when the node
starts again, measured anew with --remeasure. (What measuring costs, against its budget of 2 s a node, is a speed
goal: bench/bench_placement.py prints it.)

`python -m pytest tests/cluster/test_placement_cluster.py -s` prints each node's measurement and the split.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest

from exo_like.cluster.speed import CACHE_FILE
from exo_like.engines.layer_speed import DECODE_WINDOW, DECODE_WINDOWS
from exo_like.models.config import ModelArgs
from exo_like.models.footprint import model_footprint
from partitioning import NodeCapacity, NodeSpeed, speeds_equal
from partitioning.decision import hop_ns, hop_table
from partitioning.plan import Holder, make_speed_plan
from partitioning.speed_figures import RTT_FLOOR_US, SpeedFigures
from tests.api_server import NodeProcess, start_node, stop_nodes
from tests.checkpoints import make_checkpoint
from tests.cluster_harness import cluster_of, start_cluster, wait_until_ready
from tests.cpu_quota import CpuQuota
from tests.oracle import Oracle

PROMPT = "What is the capital of France?"
MAX_TOKENS = 16
# A measurement times the decode step over DECODE_WINDOWS windows of DECODE_WINDOW seconds each: it lasts that long
# at least, however fast or busy the machine is.
MEASURED_AT_LEAST_SECONDS = DECODE_WINDOWS * DECODE_WINDOW
NODE_IDS = ["node-a", "node-b", "node-c"]  # equal memory: the ring's order is by node id
# Room for five of the twelve layers (and the embedding or the head) a node, not six: every node takes a share, so
# what the test asserts follows from what it sets (with room for all twelve, a loaded machine's measured hops could
# make one fast node alone the quickest plan, and did). 172,544 bytes a layer; the embedding and head ~158,000.
FIVE_LAYERS_GB = 0.00096
SLOW = "node-b"


@pytest.fixture(scope="module")
def twelve_layers(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_checkpoint(tmp_path_factory.mktemp("ckpt") / "llama12", "llama", n_layers=12, max_shard_size="200KB")


def greedy_text(node: NodeProcess, model: str) -> str:
    body = json.dumps({"model": model, "messages": [{"role": "user", "content": PROMPT}], "max_tokens": MAX_TOKENS,
                       "temperature": 0}).encode()
    status, _, raw = node.request("POST", "/v1/chat/completions", body, {"Content-Type": "application/json"})
    assert status == 200, raw
    return json.loads(raw)["choices"][0]["message"]["content"]


def measured_layer_ns(home: Path, shown_ms: float) -> int:
    """A node's layer time as it measured it, to the nanosecond (GET /v1/cluster shows it in whole microseconds,
    `shown_ms`): the entry of the cache it wrote in its home that the view shows (the others, if any, are a rank's
    slice of a layer, timed for tensor-parallel groups once every member had its figure)."""
    entries = json.loads((home / CACHE_FILE).read_text()).values()
    (decode_ns,) = {e["decode_ns"] for e in entries if round(e["decode_ns"] / 1e6, 3) == shown_ms}
    return decode_ns


def planned_stages(view: dict) -> list[tuple[str, int, int]]:
    return [(s["node_id"], s["start_layer"], s["end_layer"]) for s in view["plan"]["stages"]]


def predicted_stages(view: dict, model_dir: Path, layer_ns: dict[str, int]) -> list[tuple[str, int, int]]:
    """The split partitioning/ computes from what the nodes announce (their memory, engine, layer times and links'
    round trips, as the view shows them), as every node does."""
    args = ModelArgs.from_dir(model_dir)
    footprint = model_footprint(model_dir, args.num_hidden_layers, args.tie_word_embeddings, args.quant)
    # A link's round trip as placement reads it: the finer figure the view shows, at least the floor (both are the
    # measured round trip rounded up to a power of two, from a different floor)
    hops = hop_table({n["id"]: SpeedFigures(rtt_us={peer: max(RTT_FLOOR_US, link["round_trip_us"])
                                                    for peer, link in n["links"].items()
                                                    if link["round_trip_us"] is not None})
                      for n in view["nodes"]})
    result = make_speed_plan(view["plan"]["model"], args.num_hidden_layers,
                             [NodeCapacity(n["id"], n["memory_bytes"]) for n in view["nodes"]], layer_ns, footprint,
                             {n["id"]: Holder(n["engine"], n["dtype"], n["device"]) for n in view["nodes"]},
                             lambda a, b: hop_ns(hops, a, b))
    assert result is not None, "no split by speed fits"
    return [(s.node_id, s.start_layer, s.end_layer) for s in result[0].stages]


@pytest.mark.slow
def test_a_node_slowed_to_a_quarter_core_is_placed_by_its_measured_speed(twelve_layers: Path, tmp_path: Path) -> None:
    """How many layers the slow node gets depends on more than its quota: on how fast the others run (the last
    stage also computes the LM head, about a layer's worth here) and on the links' round trips. On a fast CPU it
    rightly got more layers than a faster node holding the head. So the test asserts what follows from what it
    sets: the quota shows in the measurements, and the plan is the one placement computes from them."""
    reason = CpuQuota.unavailable()
    if reason:
        pytest.skip(reason)
    with CpuQuota("exo-like-test", 0.25) as quota:
        nodes = start_cluster(tmp_path, str(twelve_layers), [FIVE_LAYERS_GB] * 3, node_ids=NODE_IDS,
                              preexecs=[quota.join if node_id == SLOW else None for node_id in NODE_IDS])
        try:
            wait_until_ready(nodes, members=3, timeout=120)
            views = [cluster_of(node) for node in nodes]
            assert len({view["plan"]["digest"] for view in views}) == 1
            view = views[0]
            layers = {s["node_id"]: s["end_layer"] - s["start_layer"] for s in view["plan"]["stages"]}
            speeds = {n["id"]: n["speed"] for n in view["nodes"]}
            for node_id, speed in speeds.items():
                print(f"{node_id}: {layers.get(node_id, 0)} layers, {speed['decode_ms_per_layer']:.3f} ms per layer "
                      f"(measured in {speed['measure_seconds']:.2f} s)")
            print("placement:", view["placement"])
            assert view["placement"]["mode"] == "compute"
            # The quota shows through whatever else the machine runs (time waiting for CPUs other processes hold is
            # left out of a measurement): the slow node is told apart by the rule placement itself uses, not by a
            # fixed ratio that load on a shared machine moves (a quarter core measured 1.7x-4x here).
            others = [n for n in NODE_IDS if n != SLOW]
            assert all(speeds[SLOW]["decode_ms_per_layer"] > speeds[n]["decode_ms_per_layer"] for n in others), speeds
            assert not speeds_equal([NodeSpeed(n, 0, round(speeds[n]["decode_ms_per_layer"] * 1e6)) for n in NODE_IDS])
            assert all(s["measure_seconds"] >= MEASURED_AT_LEAST_SECONDS and not s["cached"] for s in speeds.values())
            assert view["placement"]["why"].startswith("split by measured speed"), view["placement"]
            layer_ns = {node_id: measured_layer_ns(tmp_path / f"home{i}", speeds[node_id]["decode_ms_per_layer"])
                        for i, node_id in enumerate(NODE_IDS)}
            # A link's round trip may be refined after the plan was agreed (the plan follows at the next
            # announcement): the plan and the figures are read again until they belong together.
            deadline = time.monotonic() + 10
            while planned_stages(view) != predicted_stages(view, twelve_layers, layer_ns) and \
                    time.monotonic() < deadline:
                time.sleep(0.2)
                view = cluster_of(nodes[0])
            assert planned_stages(view) == predicted_stages(view, twelve_layers, layer_ns), (view["nodes"], layer_ns)
            oracle = Oracle(twelve_layers)
            expected = oracle.expected(oracle.chat_ids(PROMPT), MAX_TOKENS)[0]
            for node in nodes:
                assert greedy_text(node, twelve_layers.name) == expected
        finally:
            stop_nodes(nodes)


@pytest.mark.slow
def test_the_measurement_is_cached_in_home_and_remeasured_on_request(twelve_layers: Path, tmp_path: Path) -> None:
    def speed_after_start(*extra: str) -> tuple[dict, str]:
        node = start_node(tmp_path, str(twelve_layers), "--no-mdns", "--dtype", "float32", *extra)
        try:
            wait_until_ready([node], members=1)
            (me,) = cluster_of(node)["nodes"]
            return me["speed"], node.log()
        finally:
            node.stop()

    measured, log = speed_after_start()
    assert not measured["cached"] and measured["measure_seconds"] >= MEASURED_AT_LEAST_SECONDS
    assert "measured in" in log
    cached, log = speed_after_start()
    assert cached["cached"] and cached["decode_ms_per_layer"] == measured["decode_ms_per_layer"]
    assert "read from the cache" in log
    again, log = speed_after_start("--remeasure")
    assert not again["cached"] and "measured in" in log
    print(f"measured in {measured['measure_seconds']:.2f} s; then read from the cache")
