"""Decode rates through a node's HTTP API, measured by difference (prefill and HTTP overhead cancel), for the
benches that compare set-ups: `request(i, max_tokens)` sends the i-th of several concurrent requests (distinct
prompts) and returns once it is answered. And one streamed chat's token arrival times (Stream, streamed_chat)."""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

Request = Callable[[int, int], Any]


def together(request: Request, streams: int, max_tokens: int) -> float:
    """Seconds until `streams` requests sent at once have all finished (the first error is raised)."""
    errors: list[BaseException] = []

    def one(i: int) -> None:
        try:
            request(i, max_tokens)
        except BaseException as exc:  # noqa: BLE001 (raised below)
            errors.append(exc)

    threads = [threading.Thread(target=one, args=(i,)) for i in range(streams)]
    started = time.perf_counter()
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    if errors:
        raise errors[0]
    return time.perf_counter() - started


def decode_rate(request: Request, streams: int, new_tokens: int) -> float:
    """Tokens/s of decode: N / (T(1 + N) - T(1)) for one stream; S N / (T_S(1 + N) - T_S(1)) for S at once."""
    return streams * new_tokens / (together(request, streams, 1 + new_tokens) - together(request, streams, 1))


@dataclass
class Stream:
    """A streamed chat request: when it was sent, when each text chunk arrived, its completion tokens."""

    started: float
    times: list[float] = field(default_factory=list)
    tokens: int = 0

    @property
    def ttft(self) -> float:
        return self.times[0] - self.started

    @property
    def gaps(self) -> list[float]:
        return [b - a for a, b in zip(self.times, self.times[1:])]


async def streamed_chat(session: Any, url: str, body: dict[str, Any]) -> Stream:
    """POST `body` (stream, with stream_options.include_usage) to url's chat completions with an aiohttp session."""
    result = Stream(time.perf_counter())
    async with session.post(f"{url}/v1/chat/completions", json=body) as response:
        assert response.status == 200, await response.text()
        async for line in response.content:
            if not line.startswith(b"data: ") or line.strip() == b"data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if "error" in chunk:
                raise RuntimeError(chunk["error"])
            if chunk.get("usage"):
                result.tokens = chunk["usage"]["completion_tokens"]
            if chunk["choices"] and chunk["choices"][0]["delta"].get("content"):
                result.times.append(time.perf_counter())
    return result
