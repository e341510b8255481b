"""Decode rates through a node's HTTP API, measured by difference (prefill and HTTP overhead cancel), for the
benches that compare set-ups: `request(i, max_tokens)` sends the i-th of several concurrent requests (distinct
prompts) and returns once it is answered."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
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
