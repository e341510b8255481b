"""Batch-1 decode speed of one node against a three-node ring on the same host, through the HTTP API.

Same Qwen2.5-0.5B-shaped random checkpoint (torch engine) for both. Decode-only tokens/s is measured by
difference, so prefill and HTTP overhead cancel: time a greedy request for 1 token and one for 1 + N tokens
(ignore_eos), rate = N / (T(1 + N) - T(1)). The one node and the ring run side by side and are measured in
alternating rounds; the ratio reported is the median of the rounds' ratios.

Every node process runs with the product's defaults unless told otherwise; `--spincount 300000` gives each
node libgomp's own default OpenMP spin instead of exo-like's shorter one (see exo_like/engines/torch/openmp.py), to
show what that setting is worth on a shared host.

Usage: python bench/bench_cluster.py [--new-tokens 64] [--repeats 7] [--dtype bfloat16] [--threads 2]
                                     [--spincount N]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_torch_vs_hf import build_checkpoint  # noqa: E402

from exo_like.models.demo import build_tokenizer, write_tokenizer_files  # noqa: E402
from tests.api_server import NodeProcess, start_node  # noqa: E402
from tests.cluster_harness import start_cluster, wait_until_ready  # noqa: E402

PROMPT = "Tell me about the rings of Saturn."


def timed_request(node: NodeProcess, model: str, max_tokens: int, prompt: str = PROMPT) -> float:
    body = json.dumps({"model": model, "messages": [{"role": "user", "content": prompt}], "max_tokens": max_tokens,
                       "temperature": 0, "ignore_eos": True}).encode()
    started = time.perf_counter()
    status, _, raw = node.request("POST", "/v1/chat/completions", body, {"Content-Type": "application/json"})
    elapsed = time.perf_counter() - started
    assert status == 200, raw
    assert json.loads(raw)["usage"]["completion_tokens"] == max_tokens
    return elapsed


def decode_rate(node: NodeProcess, model: str, new_tokens: int) -> float:
    short = timed_request(node, model, 1)
    long = timed_request(node, model, 1 + new_tokens)
    return new_tokens / (long - short)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--dtype", default="bfloat16", choices=("float32", "bfloat16"))
    parser.add_argument("--threads", type=int, default=2, help="torch threads per node process")
    parser.add_argument("--spincount", help="GOMP_SPINCOUNT for every node (default: exo-like's own)")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="bench-cluster-") as tmp:
        root = Path(tmp)
        model_dir = build_checkpoint(root / "qwen2.5-0.5b-shape")
        write_tokenizer_files(model_dir, build_tokenizer())
        model = model_dir.name
        dtype_flag = ("--dtype", args.dtype)
        env = {"GOMP_SPINCOUNT": args.spincount}  # None removes one inherited from this shell
        nodes: list[NodeProcess] = []
        try:
            # Both set-ups stay up (an idle node sleeps) and are measured in turn, so a drift in the machine's
            # speed (a shared VM's can be 10 % within minutes) hits both alike instead of skewing the ratio.
            single = start_node(root / "single", str(model_dir), "--no-mdns", *dtype_flag, threads=args.threads,
                                env=env)
            nodes.append(single)
            ring = start_cluster(root / "ring", str(model_dir), [8, 8, 8], extra=dtype_flag, threads=args.threads,
                                 envs=[env] * 3)
            nodes.extend(ring)
            wait_until_ready(ring, members=3, timeout=300)
            stages = ring[0].get_json("/v1/cluster")["plan"]["stages"]
            for node in (single, ring[0]):
                timed_request(node, model, args.new_tokens)  # warm-up
            ones, threes = [], []
            for _ in range(args.repeats):
                ones.append(decode_rate(single, model, args.new_tokens))
                threes.append(decode_rate(ring[0], model, args.new_tokens))
        finally:
            for node in nodes:
                node.stop()

    layout = ", ".join(f"[{s['start_layer']},{s['end_layer']})" for s in stages)
    ratios = [three / one for one, three in zip(ones, threes)]
    spin = f"GOMP_SPINCOUNT={args.spincount}" if args.spincount else "exo-like's default OpenMP spin"
    print(f"{args.threads} torch threads per node, {spin}; "
          f"{args.repeats} alternating rounds of {args.new_tokens} tokens")
    print(f"{args.dtype} batch-1 decode, median: one node {statistics.median(ones):.2f} tok/s, three nodes ({layout}) "
          f"{statistics.median(threes):.2f} tok/s")
    print(f"per-round ratios {' '.join(f'{r:.3f}' for r in ratios)}")
    print(f"three-node / one-node decode ratio {statistics.median(ratios):.3f} (median of rounds; target >= 0.95)")


if __name__ == "__main__":
    main()
