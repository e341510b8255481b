"""Structured output's cost: 8 concurrent streams each under its own JSON schema against the same 8 streams free.

One node serves SmolLM2-135M-Instruct (the `make run` model, a real trained model: its JSON is what users see).
Each round sends 8 streaming chat requests at once: first each with a `response_format` json_schema (a list of
records, different field names per stream, so that each request compiles its own grammar), then the same 8 prompts
without a schema, `ignore_eos` and max_tokens set to the length each constrained answer had, so both rounds decode
the same number of tokens per stream. A stream's decode rate is its tokens after the first over the time from its
first to its last token (prefill and the grammar's compile excluded, in both rounds alike); the figure is the sum
over the 8 streams, the median of --rounds rounds. Prints the ratio constrained / free (the target is >= 0.8).

Usage: python bench/bench_structured.py [--rounds 3] [--threads 2] [--model smollm2-135m]
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from rates import streamed_chat  # noqa: E402
from tests.api_server import start_node  # noqa: E402

STREAMS = 8
FIELDS = [("name", "score"), ("city", "population"), ("title", "year"), ("fruit", "weight"), ("planet", "moons"),
          ("author", "pages"), ("river", "length"), ("song", "plays")]


def schema(text_field: str, number_field: str) -> dict:
    record = {"type": "object", "properties": {text_field: {"type": "string", "maxLength": 24},
                                               number_field: {"type": "integer", "minimum": 0, "maximum": 100000},
                                               "tags": {"type": "array", "items": {"type": "string", "maxLength": 12},
                                                        "maxItems": 3}},
              "required": [text_field, number_field, "tags"], "additionalProperties": False}
    return {"type": "object", "properties": {"items": {"type": "array", "items": record, "minItems": 6,
                                                       "maxItems": 6}},
            "required": ["items"], "additionalProperties": False}


async def one_stream(session, url: str, model: str, i: int, constrained: bool,  # noqa: ANN001
                     max_tokens: int) -> tuple[int, float]:
    """(completion tokens, decode seconds from the first token to the last)."""
    text_field, number_field = FIELDS[i]
    body = {"model": model, "stream": True, "stream_options": {"include_usage": True}, "temperature": 0.8, "seed": i,
            "max_tokens": max_tokens,
            "messages": [{"role": "user", "content": f"List six {text_field}s with their {number_field} as JSON."}]}
    if constrained:
        body["response_format"] = {"type": "json_schema",
                                   "json_schema": {"name": "records", "schema": schema(text_field, number_field)}}
    else:
        body["ignore_eos"] = True
    stream = await streamed_chat(session, url, body)
    return stream.tokens, stream.times[-1] - stream.times[0]


async def round_(url: str, model: str, constrained: bool, lengths: list[int]) -> tuple[float, list[int]]:
    import aiohttp

    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=3600)) as session:
        results = await asyncio.gather(*(one_stream(session, url, model, i, constrained, lengths[i])
                                         for i in range(STREAMS)))
    return sum((tokens - 1) / seconds for tokens, seconds in results), [tokens for tokens, _ in results]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--model", default="smollm2-135m")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as home:
        node = start_node(Path(home), args.model, "--no-mdns", threads=args.threads)
        try:
            asyncio.run(round_(node.base_url, args.model, True, [16] * STREAMS))  # warm-up (grammar vocabulary)
            constrained, free = [], []
            for r in range(args.rounds):
                rate, lengths = asyncio.run(round_(node.base_url, args.model, True, [1024] * STREAMS))
                constrained.append(rate)
                free.append(asyncio.run(round_(node.base_url, args.model, False, lengths))[0])
                print(f"round {r}: {STREAMS} streams, tokens {lengths}: with schemas {constrained[-1]:.1f} tok/s, "
                      f"free {free[-1]:.1f} tok/s", flush=True)
        finally:
            node.stop()
    ratio = statistics.median(constrained) / statistics.median(free)
    print(f"structured output, {STREAMS} streams: {statistics.median(constrained):.1f} tok/s with a schema each, "
          f"{statistics.median(free):.1f} tok/s without; ratio {ratio:.2f} (target >= 0.80)")


if __name__ == "__main__":
    main()
