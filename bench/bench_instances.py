"""Data parallel instances: 8 concurrent streams on one model, served by one instance over four nodes against two
instances over two nodes each, same run, as a ratio.

Four nodes on this host (loopback), each pinned to one CPU (nodes 0 and 1 on the first CPU this process may use,
nodes 2 and 3 on the second; one torch thread each), placing by memory with equal memory: one instance of the model
is a four-stage pipeline over all of them; two instances (the load API with `nodes`) are two two-stage pipelines,
{0, 1} and {2, 3}, each request going to the ready instance with the fewest requests. Both set-ups are loaded and
unloaded through the API in alternating rounds, and measured by difference (prefill and HTTP overhead cancel):
S N / (T_S(1 + N) - T_S(1)) for S streams of greedy requests (ignore_eos). Printed: each round's tokens/s, the
medians, and two / one.

What it shows: a pipeline on one host keeps one batch in flight (stages on one machine share its cores), so a
four-stage ring has three stages idle at any moment while two two-stage rings keep both CPUs busy; on machines of
their own the pipeline keeps a batch per machine in flight, and the gap closes as a token's hops get cheaper
than its layers. The load API leaves the choice to the user: instances are not replicated automatically.

Model: a random checkpoint with Qwen2.5-0.5B's shapes (bench_torch_vs_hf.build_checkpoint), float32.
Usage: python bench/bench_instances.py [--rounds 3] [--streams 8] [--new-tokens 32]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_torch_vs_hf import build_checkpoint  # noqa: E402
from rates import decode_rate  # noqa: E402

from exo_like.models.demo import build_tokenizer, write_tokenizer_files  # noqa: E402
from tests.api_server import NodeProcess, stop_nodes, wait_for  # noqa: E402
from tests.cluster_harness import free_ports, launch_member  # noqa: E402

PROMPT = "Tell me about the rings of Saturn."
HEADERS = {"Content-Type": "application/json"}


def pinned(cpu: int):  # type: ignore[no-untyped-def]
    return lambda: os.sched_setaffinity(0, {cpu})


def start_four(root: Path) -> list[NodeProcess]:
    cpus = sorted(os.sched_getaffinity(0))
    if len(cpus) < 2:
        raise SystemExit("needs at least 2 CPUs")
    ports = free_ports(4)
    launched = [launch_member(root, None, ports, i, 4.0, extra=("--placement", "memory"),
                              preexec=pinned(cpus[0] if i < 2 else cpus[1])) for i in range(4)]
    return [node.serving() for node in launched]


def instances(node: NodeProcess) -> list[dict]:
    return node.get_json("/v1/instances")["data"]


def load(node: NodeProcess, model: str, groups: list[list[str]]) -> None:
    for nodes in groups:
        status, _, raw = node.request("POST", "/v1/instances", json.dumps({"model": model, "nodes": nodes}).encode(),
                                      HEADERS)
        assert status == 202, raw
    assert wait_for(lambda: len(instances(node)) == len(groups) and all(i["ready"] for i in instances(node)),
                    timeout=300), instances(node)


def unload(node: NodeProcess, model: str) -> None:
    status, _, raw = node.request("DELETE", f"/v1/instances/{model}")
    assert status == 200, raw
    assert wait_for(lambda: instances(node) == [], timeout=60), instances(node)


def rate(nodes: list[NodeProcess], model: str, streams: int, new_tokens: int) -> float:
    """Aggregate decode tokens/s of `streams` requests at once, sent round-robin to the four nodes' APIs."""
    def request(i: int, max_tokens: int) -> None:
        body = {"model": model, "messages": [{"role": "user", "content": f"{PROMPT} ({i})"}], "max_tokens": max_tokens,
                "temperature": 0, "ignore_eos": True}
        status, _, raw = nodes[i % len(nodes)].request("POST", "/v1/chat/completions", json.dumps(body).encode(),
                                                       HEADERS)
        assert status == 200, raw

    request(0, 2)  # warm: the first request of a set-up pays for its first steps' allocations
    return decode_rate(request, streams, new_tokens)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--streams", type=int, default=8)
    parser.add_argument("--new-tokens", type=int, default=32)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="bench-instances-") as tmp:
        root = Path(tmp)
        model_dir = build_checkpoint(root / "qwen2.5-0.5b-shape")
        write_tokenizer_files(model_dir, build_tokenizer())
        model = str(model_dir)
        nodes = start_four(root)
        try:
            assert wait_for(lambda: len(nodes[0].get_json("/v1/cluster")["nodes"]) == 4, timeout=60)
            by_port = {int(n["address"].rsplit(":", 1)[1]): n["id"] for n in nodes[0].get_json("/v1/cluster")["nodes"]}
            ordered = [by_port[node.port] for node in nodes]  # node i's id
            one, two = [], []
            print(f"load average {os.getloadavg()[0]:.2f}; {args.streams} streams x {args.new_tokens} tokens; "
                  f"nodes 0,1 on one CPU, 2,3 on another", flush=True)
            for round_ in range(args.rounds):
                for name, groups, results in (("one instance over 4 nodes", [[]], one),
                                              ("two instances over 2 nodes each", [ordered[:2], ordered[2:]], two)):
                    load(nodes[0], model, groups)
                    started = time.monotonic()
                    results.append(rate(nodes, model, args.streams, args.new_tokens))
                    print(f"round {round_ + 1}: {name}: {results[-1]:.1f} tok/s "
                          f"({time.monotonic() - started:.0f} s)", flush=True)
                    unload(nodes[0], model)
            a, b = statistics.median(one), statistics.median(two)
            print(f"median: one instance {a:.1f} tok/s, two instances {b:.1f} tok/s; two / one = {b / a:.2f}")
        finally:
            stop_nodes(nodes)


if __name__ == "__main__":
    main()
