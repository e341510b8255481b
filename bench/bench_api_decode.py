"""Single-stream decode through a node's API against what the engine's own decode step allows, same file, one run
(issue 44's second acceptance line: within 5 %).

- engine: the file loaded whole by one TorchEngine on an engine thread (bench_vs_llamacpp.ExoSide), greedy decode
  of --gen tokens, one step per token, as that bench's tgN;
- API: an `exo-like` process serving the same file (OMP_NUM_THREADS = --threads), a completion of 1 token and one of
  1 + --gen tokens (temperature 0, ignore_eos) on the same short prompt, not streamed: decode = gen / (the
  difference of their times), so the prompt, the HTTP round trip and the request's set-up cancel out.
Each repeat times the engine, then the API (the node idles while the engine runs, and the other way round);
medians over repeats, with ratio = API / engine. A node step also samples on the last stage (penalties, top-k
machinery) and passes the token through the ring and the detokenizer: the gap is what those cost.

Usage: python bench/bench_api_decode.py [--model smollm2-135m|PATH.gguf] [--threads 2] [--gen 64] [--repeats 3]
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

import bench_vs_llamacpp as bench  # noqa: E402  (sets the OpenMP spin limit before torch loads)

from exo_like.models.names.catalog import PACKAGED  # noqa: E402
from tests.api_server import NodeProcess, start_node  # noqa: E402

PROMPT = "Write a story about a lighthouse keeper."


def completion_seconds(node: NodeProcess, model: str, max_tokens: int) -> float:
    body = json.dumps({"model": model, "prompt": PROMPT, "max_tokens": max_tokens, "temperature": 0,
                       "ignore_eos": True}).encode()
    started = time.perf_counter()
    status, _, raw = node.request("POST", "/v1/completions", body, {"Content-Type": "application/json"})
    elapsed = time.perf_counter() - started
    assert status == 200, raw
    assert json.loads(raw)["usage"]["completion_tokens"] == max_tokens, raw
    return elapsed


def api_decode_rate(node: NodeProcess, model: str, gen: int) -> float:
    """Tokens/s of decode through the API: the 1-token request's time taken from the (1 + gen)-token one's."""
    one = statistics.median(completion_seconds(node, model, 1) for _ in range(3))
    more = completion_seconds(node, model, 1 + gen)
    return gen / (more - one)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--gen", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    opts = parser.parse_args()
    packaged = PACKAGED.get(opts.model)
    path = packaged.path() if packaged is not None else Path(opts.model)
    if path is None or not path.is_file():
        sys.exit(f"{opts.model}: no such GGUF file (the smollm2-135m wheel is installed by `make run`)")
    bench.torch.set_num_threads(opts.threads)
    engine = bench.ExoSide(path, None, argparse.Namespace(depth=0, prompts=[64], gen=opts.gen))
    with tempfile.TemporaryDirectory() as home:
        node = start_node(Path(home), str(path), "--no-mdns", threads=opts.threads)
        try:
            model = path.stem
            completion_seconds(node, model, 8)  # warm: the node's first request builds its caches
            engine.on_engine(engine._gen, 8)
            rates: dict[str, list[float]] = {"engine": [], "api": []}
            for _ in range(opts.repeats):
                rates["engine"].append(engine.on_engine(engine._gen, opts.gen))
                rates["api"].append(api_decode_rate(node, model, opts.gen))
        finally:
            node.stop()
            engine.close()
    engine_rate, api_rate = (statistics.median(rates[side]) for side in ("engine", "api"))
    print(f"{path.name}, {opts.threads} threads, tg{opts.gen}, median of {opts.repeats}")
    print(f"  engine step  {engine_rate:7.1f} tok/s  ({1000 / engine_rate:.2f} ms a token)   runs: "
          + ", ".join(f"{r:.1f}" for r in rates["engine"]))
    print(f"  through API  {api_rate:7.1f} tok/s  ({1000 / api_rate:.2f} ms a token)   runs: "
          + ", ".join(f"{r:.1f}" for r in rates["api"]))
    print(f"  ratio API / engine: {api_rate / engine_rate:.2f}")


if __name__ == "__main__":
    main()
