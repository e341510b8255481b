"""Serving many users at once, through the HTTP API: continuous batching measured against llama.cpp and ourselves.

For each dtype (float32, bfloat16) and each number of concurrent streaming requests (1, 2, 4, 8, 16), prints the
aggregate output tokens/s and the p50/p99 time to first token and inter-token latency, for
  (a) a SmolLM2-135M-shaped random checkpoint on one node, side by side with llama.cpp (`llama-bench`, same
      threads) on a GGUF conversion of the same checkpoint: its `tg` (one stream's decode) and `pp8` (a batch of
      8 tokens in one forward, the cost of one batched decode step of 8 sequences);
  (b) the Qwen2.5-0.5B shape on one node and on a three-node ring on this host;
  (c) a Qwen3-MoE shape (~1 B parameters, 8 of 64 experts a token) on one node: the 8-stream / 1-stream ratio;
then the ratios the serving targets are stated in, and two scheduling checks on the SmolLM2 shape:
  - interleaving: while 4 streams decode, a request with a 4,000-token prompt arrives; the 4 streams' p99
    inter-token latency during that prefill against their median;
  - prefix cache: time to first token of a chat sharing a 1,000-token system prompt with an earlier one.

The random weights are scaled to give peaky logits, and every token id that does not decode to whole text
(ids past the tokenizer's, byte pieces of a character) gets a zero embedding row: a greedy stream then emits
one text chunk per token, so the client sees every token's arrival time.

Usage: python bench/bench_concurrency.py [--dtypes float32,bfloat16] [--streams 1,2,4,8,16] [--new-tokens 64]
           [--threads 2] [--sections smollm,qwen,moe,interleave,prefix] [--no-llamacpp]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_torch_vs_hf import QWEN25_05B, peaky_state  # noqa: E402
from rates import Stream, streamed_chat  # noqa: E402

from exo_like.models.demo import build_tokenizer, write_tokenizer_files  # noqa: E402
from tests.api_server import NodeProcess, start_node  # noqa: E402
from tests.cluster_harness import start_cluster, wait_until_ready  # noqa: E402

# The workplace keeps it beside the repository; a checkout elsewhere names it in LLAMACPP_SH.
LLAMACPP = Path(os.environ.get("LLAMACPP_SH") or
                Path(__file__).resolve().parents[2] / "shared" / "tools" / "llamacpp.sh")
SMOLLM2_135M = {
    "hidden_size": 576, "num_hidden_layers": 30, "num_attention_heads": 9, "num_key_value_heads": 3,
    "head_dim": 64, "intermediate_size": 1536, "vocab_size": 49152, "max_position_embeddings": 8192,
    "rope_theta": 100000.0, "rms_norm_eps": 1e-5, "tie_word_embeddings": True,
}
# bench_vs_llamacpp.py's Qwen3-MoE shape (~1 B parameters, 8 of 64 experts per token, ~0.2 B active), its embedding
# tied to the head so that only whole-text tokens can win (see build_checkpoint).
QWEN3_MOE_1B = {
    "hidden_size": 1024, "num_hidden_layers": 12, "num_attention_heads": 16, "num_key_value_heads": 4,
    "head_dim": 64, "intermediate_size": 3072, "moe_intermediate_size": 384, "num_experts": 64,
    "num_experts_per_tok": 8, "norm_topk_prob": True, "vocab_size": 32000, "max_position_embeddings": 32768,
    "rope_theta": 1000000.0, "rms_norm_eps": 1e-6, "tie_word_embeddings": True,
}
TOPICS = ["the rings of Saturn", "bread baking", "the history of Rome", "tide pools", "jazz harmony", "glaciers",
          "chess openings", "volcanoes", "honey bees", "the printing press", "coral reefs", "sailing knots",
          "the moon landing", "desert plants", "violins", "city trams"]


# -- checkpoints ----------------------------------------------------------------------------------------------


def build_checkpoint(path: Path, config: dict, arch: str) -> Path:
    """A random checkpoint of the given shape with the demo tokenizer; only ids that decode to whole text can win
    a greedy pick (the others' embedding rows, which are also the tied LM head, are zero)."""
    from transformers import (LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM, Qwen3MoeConfig,
                              Qwen3MoeForCausalLM)

    config_class, model_class = {"llama": (LlamaConfig, LlamaForCausalLM),
                                 "qwen2": (Qwen2Config, Qwen2ForCausalLM),
                                 "qwen3_moe": (Qwen3MoeConfig, Qwen3MoeForCausalLM)}[arch]
    tokenizer = build_tokenizer()
    with torch.device("meta"):
        model = model_class(config_class(**config))
    state = peaky_state(model)
    embedding = state["model.embed_tokens.weight"]
    embedding[~torch.from_numpy(_text_tokens(tokenizer, embedding.shape[0]))] = 0.0
    model.load_state_dict(state, strict=False, assign=True)
    model.tie_weights()
    model.save_pretrained(path)
    write_tokenizer_files(path, tokenizer)
    return path


def _text_tokens(tokenizer, vocab_size: int) -> np.ndarray:  # noqa: ANN001
    keep = np.zeros(vocab_size, dtype=bool)
    for token_id in range(min(vocab_size, tokenizer.get_vocab_size())):
        text = tokenizer.decode([token_id])
        keep[token_id] = bool(text.strip()) and "\ufffd" not in text and not text.startswith("<|")
    return keep


# -- one load level -------------------------------------------------------------------------------------------


async def stream_chat(session, url: str, model: str, content: str, max_tokens: int,  # noqa: ANN001
                      system: str | None = None) -> Stream:
    messages = ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": content}]
    body = {"model": model, "messages": messages, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
            "stream": True, "stream_options": {"include_usage": True}}
    return await streamed_chat(session, url, body)


@dataclass
class Level:
    streams: int
    tokens_per_second: float
    ttft: list[float]
    gaps: list[float]
    decode_rate: float  # one stream's tokens/s from its first token to its last, median over streams


async def run_level(url: str, model: str, streams: int, new_tokens: int, round_: int) -> Level:
    import aiohttp

    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=3600)) as session:
        started = time.perf_counter()
        results = await asyncio.gather(*(
            stream_chat(session, url, model, f"Request {round_}.{i}: tell me about {TOPICS[i % len(TOPICS)]}.",
                        new_tokens) for i in range(streams)))
        elapsed = time.perf_counter() - started
    assert all(r.tokens == new_tokens for r in results), [r.tokens for r in results]
    chunks = [len(r.times) for r in results]
    assert min(chunks) >= new_tokens - 2, f"fewer text chunks than tokens: {chunks}"
    return Level(streams, sum(r.tokens for r in results) / elapsed, [r.ttft for r in results],
                 [g for r in results for g in r.gaps],
                 statistics.median((len(r.times) - 1) / (r.times[-1] - r.times[0]) for r in results))


def percentile(values: list[float], q: float) -> float:
    return float(np.percentile(values, q)) if values else float("nan")


def print_level(label: str, level: Level) -> None:
    print(f"  {label:<26} {level.streams:>3} streams: {level.tokens_per_second:7.1f} tok/s aggregate, "
          f"TTFT p50 {percentile(level.ttft, 50) * 1000:7.0f} ms p99 {percentile(level.ttft, 99) * 1000:7.0f} ms, "
          f"ITL p50 {percentile(level.gaps, 50) * 1000:6.1f} ms p99 {percentile(level.gaps, 99) * 1000:6.1f} ms",
          flush=True)


def sweep(label: str, node: NodeProcess, model: str, stream_counts: list[int], new_tokens: int) -> dict[int, Level]:
    asyncio.run(run_level(node.base_url, model, 2, 8, -1))  # warm-up
    levels = {}
    for i, count in enumerate(stream_counts):
        levels[count] = asyncio.run(run_level(node.base_url, model, count, new_tokens, i))
        print_level(label, levels[count])
    return levels


def sweep_one_node(label: str, home: Path, model_dir: Path, dtype: str, args: argparse.Namespace) -> dict[int, Level]:
    node = start_node(home, str(model_dir), "--no-mdns", "--dtype", dtype, threads=args.threads)
    try:
        return sweep(label, node, model_dir.name, args.streams, args.new_tokens)
    finally:
        node.stop()


# -- llama.cpp ------------------------------------------------------------------------------------------------


def llamacpp_rates(model_dir: Path, dtype: str, threads: int, work: Path) -> dict[str, float] | None:
    """llama-bench's tg (decode of one stream) and pp8 (8 tokens in one forward) tokens/s on a GGUF conversion."""
    gguf = work / f"{model_dir.name}-{dtype}.gguf"
    outtype = {"float32": "f32", "bfloat16": "bf16"}[dtype]
    try:
        if not gguf.exists():
            # llama-bench never tokenizes; the converter only needs a pre-tokenizer name it knows for ours.
            env = {**os.environ, "LLAMACPP_PRE": os.environ.get("LLAMACPP_PRE", "smollm")}
            subprocess.run(["bash", str(LLAMACPP), "convert", str(model_dir), str(gguf), outtype], check=True,
                           capture_output=True, text=True, env=env)
        out = subprocess.run(["bash", str(LLAMACPP), "bench", str(gguf), "-t", str(threads), "-p", "8", "-n", "64",
                              "-r", "3", "-o", "json"], check=True, capture_output=True, text=True).stdout
    except (subprocess.CalledProcessError, FileNotFoundError) as exc:
        print(f"  llama.cpp unavailable: {getattr(exc, 'stderr', exc)!s:.300}")
        return None
    rates = {}
    for row in json.loads(out):
        key = "tg" if row["n_gen"] else f"pp{row['n_prompt']}"
        rates[key] = row["avg_ts"]
    return rates


# -- sections -------------------------------------------------------------------------------------------------


def smollm_section(root: Path, args: argparse.Namespace) -> None:
    model_dir = build_checkpoint(root / "smollm2-135m-shape", SMOLLM2_135M, "llama")
    for dtype in args.dtypes:
        print(f"\n(a) SmolLM2-135M shape, {dtype}, one node, {args.threads} threads", flush=True)
        levels = sweep_one_node("exo-like", root / f"smollm-{dtype}", model_dir, dtype, args)
        theirs = None if args.no_llamacpp else llamacpp_rates(model_dir, dtype, args.threads, root)
        one = levels.get(1)
        eight = levels.get(8)
        if theirs:
            print(f"  llama.cpp {dtype}: tg {theirs['tg']:.1f} tok/s, pp8 {theirs['pp8']:.1f} tok/s")
        if one and theirs:
            print(f"  ratio: one stream decode {one.decode_rate:.1f} / llama.cpp tg = "
                  f"{one.decode_rate / theirs['tg']:.2f} (target >= 0.8)")
        if eight and theirs:
            print(f"  ratio: 8 streams aggregate {eight.tokens_per_second:.1f} / llama.cpp pp8 = "
                  f"{eight.tokens_per_second / theirs['pp8']:.2f} (target >= 0.8)")
        if eight and one:
            print(f"  ratio: 8 streams / one stream aggregate = {eight.tokens_per_second / one.tokens_per_second:.2f} "
                  "(target >= 3)", flush=True)


def qwen_section(root: Path, args: argparse.Namespace) -> None:
    model_dir = build_checkpoint(root / "qwen2.5-0.5b-shape", QWEN25_05B, "qwen2")
    for dtype in args.dtypes:
        print(f"\n(b) Qwen2.5-0.5B shape, {dtype}, one node and a three-node ring on this host", flush=True)
        single = sweep_one_node("one node", root / f"qwen-{dtype}", model_dir, dtype, args)
        ring = start_cluster(root / f"qwen-ring-{dtype}", str(model_dir), [8, 8, 8],
                             extra=("--dtype", dtype), threads=args.threads)
        try:
            wait_until_ready(ring, members=3, timeout=600)
            three = sweep("three-node ring", ring[0], model_dir.name, args.streams, args.new_tokens)
        finally:
            for member in ring:
                member.stop()
        if 8 in single and 8 in three:
            print(f"  ratio: ring / one node at 8 streams = "
                  f"{three[8].tokens_per_second / single[8].tokens_per_second:.2f} (target >= 0.85)", flush=True)


def moe_section(root: Path, args: argparse.Namespace) -> None:
    model_dir = build_checkpoint(root / "qwen3-moe-1b-shape", QWEN3_MOE_1B, "qwen3_moe")
    for dtype in args.dtypes:
        print(f"\n(c) Qwen3-MoE shape (1 B total, 0.2 B active), {dtype}, one node, {args.threads} threads", flush=True)
        levels = sweep_one_node("exo-like", root / f"moe-{dtype}", model_dir, dtype, args)
        if 1 in levels and 8 in levels:
            print(f"  ratio: 8 streams / one stream aggregate = "
                  f"{levels[8].tokens_per_second / levels[1].tokens_per_second:.2f}", flush=True)


async def interleave(url: str, model: str, new_tokens: int) -> tuple[list[float], list[float], float]:
    """Gaps of 4 decoding streams before and while a 4,000-token prompt is prefilled."""
    import aiohttp

    long_prompt = " ".join(f"Line {i}: the quick brown fox jumps over the lazy dog." for i in range(330))
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=3600)) as session:
        streams = [asyncio.ensure_future(stream_chat(session, url, model, f"Stream {i}: tell me about "
                                                     f"{TOPICS[i]}.", new_tokens)) for i in range(4)]
        await asyncio.sleep(2.0)  # they are decoding
        long_started = time.perf_counter()
        long = await stream_chat(session, url, model, long_prompt, 1)
        prefill_end = long.times[0] if long.times else time.perf_counter()
        results = await asyncio.gather(*streams)
    during, outside = [], []
    for r in results:
        for a, b in zip(r.times, r.times[1:]):
            if b > long_started and a < prefill_end:
                during.append(b - a)
            else:
                outside.append(b - a)
    return outside, during, prefill_end - long_started


@contextlib.contextmanager
def smollm_node(root: Path, name: str, args: argparse.Namespace):  # noqa: ANN201
    """A warmed-up node serving the SmolLM2-shaped checkpoint in the first dtype asked for."""
    model_dir = root / "smollm2-135m-shape"
    if not model_dir.exists():
        build_checkpoint(model_dir, SMOLLM2_135M, "llama")
    node = start_node(root / name, str(model_dir), "--no-mdns", "--dtype", args.dtypes[0], threads=args.threads)
    try:
        asyncio.run(run_level(node.base_url, model_dir.name, 1, 4, -1))
        yield node, model_dir.name
    finally:
        node.stop()


def interleave_section(root: Path, args: argparse.Namespace) -> None:
    print(f"\nInterleaving, SmolLM2 shape, {args.dtypes[0]}: 4 streams decode while a 4,000-token prompt arrives",
          flush=True)
    with smollm_node(root, "interleave", args) as (node, model):
        outside, during, prefill = asyncio.run(interleave(node.base_url, model, 400))
    median = statistics.median(outside)
    print(f"  prefill took {prefill:.1f} s; the 4 streams' inter-token latency: median {median * 1000:.1f} ms "
          f"without the long prompt ({len(outside)} gaps), during its prefill median "
          f"{statistics.median(during) * 1000:.1f} ms, p99 {percentile(during, 99) * 1000:.1f} ms ({len(during)} gaps)")
    print(f"  ratio: p99 during prefill / median = {percentile(during, 99) / median:.2f} (target <= 3)", flush=True)


async def prefix(url: str, model: str, system: str) -> tuple[float, float]:
    import aiohttp

    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=3600)) as session:
        first = await stream_chat(session, url, model, "What is a tide pool?", 8, system=system)
        second = await stream_chat(session, url, model, "And what lives in one?", 8, system=system)
    return first.ttft, second.ttft


def prefix_section(root: Path, args: argparse.Namespace) -> None:
    system = " ".join(f"Rule {i}: answer briefly and politely, in plain words." for i in range(28))
    print(f"\nPrefix cache, SmolLM2 shape, {args.dtypes[0]}: two chats sharing a ~1,000-token system prompt",
          flush=True)
    with smollm_node(root, "prefix", args) as (node, model):
        first, second = asyncio.run(prefix(node.base_url, model, system))
        hits = node.get_json("/v1/cluster")["nodes"][0]
    print(f"  TTFT first {first * 1000:.0f} ms, second {second * 1000:.0f} ms; prefix cache reused "
          f"{hits['prefix_hits']} of {hits['prefix_queries']} prompt tokens")
    print(f"  ratio: second / first TTFT = {second / first:.2f} (target <= 0.3)", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dtypes", default="float32,bfloat16")
    parser.add_argument("--streams", default="1,2,4,8,16")
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--sections", default="smollm,qwen,moe,interleave,prefix")
    parser.add_argument("--no-llamacpp", action="store_true")
    args = parser.parse_args()
    args.dtypes = args.dtypes.split(",")
    args.streams = [int(n) for n in args.streams.split(",")]
    sections = {"smollm": smollm_section, "qwen": qwen_section, "moe": moe_section,
                "interleave": interleave_section, "prefix": prefix_section}
    print(f"exo-like serving bench: {args.threads} threads per process, {args.new_tokens} new tokens per stream, "
          f"{os.cpu_count()} cpus", flush=True)
    with tempfile.TemporaryDirectory(prefix="bench-concurrency-") as tmp:
        for name in args.sections.split(","):
            sections[name](Path(tmp), args)


if __name__ == "__main__":
    main()
