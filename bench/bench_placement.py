"""Placement by speed against placement by memory, on a three-node ring with one slow node, on one host.

Three nodes of equal --memory-gb, one torch thread each, on the Qwen2.5-0.5B-shaped random checkpoint (bfloat16
by default). One of them (node-b: the middle of the ring, whose order among equal memories is by node id; pick
another with --slow) is held to a quarter of a core by a cgroup CPU quota: a machine four times slower than the
others. The quota's period is 10 ms by default (--period-ms), not the kernel's 100 ms: a quota is a duty-cycle
limit, and with a 100 ms period a stage busy less than 25 ms in every 100 ms runs at full speed. On one host the
ring keeps one batch in flight, so each stage is busy only for its share of a step: under the memory split the
middle stage's share is about a quarter, and a 100 ms-period quota hardly ever bites (measured: ratio 1.03 at batch
1, 1.05 at 8 streams). A 10 ms period slows every step longer than 2.5 ms, as a slower machine would.

The same set-up runs twice, side by side: once with --placement memory (8 layers each, as before) and
once with --placement compute (layers by measured speed). Both stay up and are measured in alternating rounds,
so a drift in the machine's speed hits both alike.

Decode tokens/s is measured by difference, so prefill and HTTP overhead cancel: batch 1: a greedy request of
1 token and one of 1 + N tokens (ignore_eos), rate = N / (T(1 + N) - T(1)); 8 streams: 8 such requests at once,
rate = 8 N / (T8(1 + N) - T8(1)). Medians over the rounds; the ratio is compute / memory.

Printed too: each node's measured layer speed and what measuring cost it (the budget is 2 s a node), and the
placement report of each ring (its stages' share of the time per token, the bottleneck).

Needs root on cgroups (v1 cpu controller or v2 cpu.max). Usage:
    python bench/bench_placement.py [--new-tokens 32] [--repeats 3] [--streams 8] [--dtype bfloat16]
                                    [--slow node-b] [--quota 0.25] [--period-ms 10]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from contextlib import ExitStack
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_cluster import PROMPT, timed_request  # noqa: E402
from bench_torch_vs_hf import build_checkpoint  # noqa: E402
from rates import Request, decode_rate, together  # noqa: E402

from exo_like.models.demo import build_tokenizer, write_tokenizer_files  # noqa: E402
from tests.api_server import NodeProcess  # noqa: E402
from tests.cluster_harness import cluster_of, start_cluster, wait_until_ready  # noqa: E402
from tests.cpu_quota import CpuQuota  # noqa: E402

NODE_IDS = ["node-a", "node-b", "node-c"]


def sender(node: NodeProcess, model: str) -> Request:
    """The i-th of several requests to `node` (distinct prompts)."""
    return lambda i, max_tokens: timed_request(node, model, max_tokens, f"{PROMPT} ({i})")


def describe(view: dict[str, Any]) -> list[str]:
    layers = {s["node_id"]: (s["start_layer"], s["end_layer"]) for s in view["plan"]["stages"]}
    placement = view["placement"]
    lines = [f"  placement: {placement['mode']} ({placement['why']})"]
    for node in view["nodes"]:
        span = layers.get(node["id"])
        where = f"layers [{span[0]}, {span[1]})" if span else "no layers"
        speed = node["speed"]
        measured = (f"decode {speed['decode_ms_per_layer']:.2f} ms/layer, prefill "
                    f"{speed['prefill_ms_per_token']:.3f} ms/position/layer, measured in "
                    f"{speed['measure_seconds']:.2f} s{' (cached)' if speed['cached'] else ''}") if speed else \
            "not measured (--placement memory)"
        share = f", {node['share']:.0%} of a token's time" if node["share"] is not None else ""
        lines.append(f"  {node['id']}: {where}; {measured}{share}{' [bottleneck]' if node['bottleneck'] else ''}")
    if placement["time_per_token_ms"] is not None:
        lines.append(f"  model: {placement['time_per_token_ms']:.1f} ms per token, slowest stage "
                     f"{placement['bottleneck_ms']:.1f} ms")
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--streams", type=int, default=8)
    parser.add_argument("--dtype", default="bfloat16", choices=("float32", "bfloat16"))
    parser.add_argument("--slow", default="node-b", choices=NODE_IDS, help="the node held to --quota of a core")
    parser.add_argument("--quota", type=float, default=0.25, help="share of one core the slow node gets")
    parser.add_argument("--period-ms", type=float, default=10.0,
                        help="the quota's scheduler period (the kernel's default is 100 ms; see above)")
    args = parser.parse_args()
    reason = CpuQuota.unavailable()
    if reason:
        sys.exit(f"bench_placement needs a CPU quota for its slow node: {reason}")
    results: dict[str, dict[int, list[float]]] = {mode: {1: [], args.streams: []} for mode in ("memory", "compute")}
    views: dict[str, dict[str, Any]] = {}
    with tempfile.TemporaryDirectory(prefix="bench-placement-") as tmp, ExitStack() as stack:
        root = Path(tmp)
        model_dir = build_checkpoint(root / "qwen2.5-0.5b-shape")
        write_tokenizer_files(model_dir, build_tokenizer())
        model = model_dir.name
        rings: dict[str, list[NodeProcess]] = {}
        try:
            # The compute ring first: its nodes measure their speed while nothing else runs on the host.
            for mode in ("compute", "memory"):
                quota = stack.enter_context(CpuQuota(f"exo-like-bench-{mode}", args.quota,
                                                     int(args.period_ms * 1000)))
                started = time.monotonic()
                rings[mode] = start_cluster(root / mode, str(model_dir), [8, 8, 8], node_ids=NODE_IDS,
                                            extra=("--dtype", args.dtype, "--placement", mode),
                                            preexecs=[quota.join if n == args.slow else None for n in NODE_IDS])
                wait_until_ready(rings[mode], members=3, timeout=600)
                views[mode] = cluster_of(rings[mode][0])
                print(f"{mode} ring ready in {time.monotonic() - started:.0f} s", flush=True)
            for ring in rings.values():
                timed_request(ring[0], model, args.new_tokens)  # warm-up
                together(sender(ring[0], model), args.streams, 4)
            for round_ in range(args.repeats):
                for mode, ring in rings.items():
                    for streams in results[mode]:
                        results[mode][streams].append(decode_rate(sender(ring[0], model), streams, args.new_tokens))
                print(f"round {round_ + 1}: " + "; ".join(
                    f"{mode} " + ", ".join(f"{s}: {r[-1]:.2f}" for s, r in results[mode].items())
                    for mode in results), flush=True)
        finally:
            for ring in rings.values():
                for node in ring:
                    node.stop()

    print(f"\n{args.dtype}, one torch thread per node, {args.slow} held to {args.quota:.0%} of a core "
          f"(per {args.period_ms:g} ms period); "
          f"{args.repeats} alternating rounds of {args.new_tokens} new tokens")
    for mode in ("memory", "compute"):
        print(f"--placement {mode}:")
        print("\n".join(describe(views[mode])))
    for streams in (1, args.streams):
        memory, compute = (statistics.median(results[m][streams]) for m in ("memory", "compute"))
        label = "batch-1" if streams == 1 else f"{streams}-stream"
        print(f"{label} decode: memory {memory:.2f} tok/s, compute {compute:.2f} tok/s, ratio {compute / memory:.2f} "
              "(target >= 1.3)")


if __name__ == "__main__":
    main()
