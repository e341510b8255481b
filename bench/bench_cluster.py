"""Batch-1 decode speed of one node against a three-node ring on the same host, through the HTTP API.

Same Qwen2.5-0.5B-shaped random checkpoint (torch engine) for both. Decode-only tokens/s is measured by
difference, so prefill and HTTP overhead cancel: time a greedy request for 1 token and one for 1 + N tokens
(ignore_eos), rate = N / (T(1 + N) - T(1)). Repeated, median reported; runs of the one node and of the ring are
taken in the same run of this script.

Usage: python bench/bench_cluster.py [--new-tokens 64] [--repeats 3] [--dtype bfloat16]
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

from exo_like.demo import build_tokenizer, write_tokenizer_files  # noqa: E402
from tests.api_server import NodeProcess, start_node  # noqa: E402
from tests.cluster_harness import start_cluster, wait_until_ready  # noqa: E402

PROMPT = "Tell me about the rings of Saturn."


def timed_request(node: NodeProcess, model: str, max_tokens: int) -> float:
    body = json.dumps({"model": model, "messages": [{"role": "user", "content": PROMPT}], "max_tokens": max_tokens,
                       "temperature": 0, "ignore_eos": True}).encode()
    started = time.perf_counter()
    status, _, raw = node.request("POST", "/v1/chat/completions", body, {"Content-Type": "application/json"})
    elapsed = time.perf_counter() - started
    assert status == 200, raw
    assert json.loads(raw)["usage"]["completion_tokens"] == max_tokens
    return elapsed


def decode_rate(node: NodeProcess, model: str, new_tokens: int, repeats: int) -> float:
    timed_request(node, model, new_tokens)  # warm-up
    rates = []
    for _ in range(repeats):
        short = timed_request(node, model, 1)
        long = timed_request(node, model, 1 + new_tokens)
        rates.append(new_tokens / (long - short))
    return statistics.median(rates)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--dtype", default="bfloat16", choices=("float32", "bfloat16"))
    parser.add_argument("--threads", type=int, default=2, help="torch threads per node process")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="bench-cluster-") as tmp:
        root = Path(tmp)
        model_dir = build_checkpoint(root / "qwen2.5-0.5b-shape")
        write_tokenizer_files(model_dir, build_tokenizer())
        model = model_dir.name
        dtype_flag = ("--dtype", args.dtype)

        single = start_node(root / "single", str(model_dir), "--no-mdns", *dtype_flag, threads=args.threads)
        try:
            one = decode_rate(single, model, args.new_tokens, args.repeats)
        finally:
            single.stop()

        ring = start_cluster(root / "ring", str(model_dir), [8, 8, 8], extra=dtype_flag, threads=args.threads)
        try:
            wait_until_ready(ring, members=3, timeout=300)
            stages = ring[0].get_json("/v1/cluster")["plan"]["stages"]
            three = decode_rate(ring[0], model, args.new_tokens, args.repeats)
        finally:
            for node in ring:
                node.stop()

    layout = ", ".join(f"[{s['start_layer']},{s['end_layer']})" for s in stages)
    print(f"{args.dtype} batch-1 decode: one node {one:.2f} tok/s, three nodes ({layout}) {three:.2f} tok/s")
    print(f"three-node / one-node decode ratio {three / one:.3f} (target >= 0.95)")


if __name__ == "__main__":
    main()
