"""The token-level generation loop, behind one small interface.

`TokenGenerator.generate` turns prompt tokens into a stream of sampled token ids. The local implementation
runs every shard of the model on this node; the cluster replaces it with a ring of stages on several nodes
without touching the HTTP layer above.

Closing the async generator (the client went away, a stop string matched, an error) always frees the
request's KV cache: callers should iterate it inside `contextlib.aclosing`.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from abc import ABC, abstractmethod
from collections.abc import AsyncIterator, Callable, Collection
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import TypeVar

import numpy as np

from exo_like.engines.base import Engine
from exo_like.sampling import Sampler, SamplingParams

log = logging.getLogger(__name__)

PREFILL_CHUNK = 512
T = TypeVar("T")


@dataclass
class RequestProgress:
    """What a dashboard shows about one in-flight request."""

    request_id: str
    prompt_tokens: int
    max_tokens: int
    generated_tokens: int = 0
    started: float = field(default_factory=time.time)

    def to_json(self) -> dict[str, object]:
        return {
            "id": self.request_id,
            "prompt_tokens": self.prompt_tokens,
            "generated_tokens": self.generated_tokens,
            "max_tokens": self.max_tokens,
            "age_seconds": round(time.time() - self.started, 3),
        }


class TokenGenerator(ABC):
    """Prompt tokens in, sampled tokens out; one request per call, any number of requests concurrently."""

    def __init__(self) -> None:
        self.in_flight: dict[str, RequestProgress] = {}
        self.tokens_generated_total = 0
        self.requests_total = 0

    @abstractmethod
    def generate(self, request_id: str, prompt_tokens: list[int], sampling: SamplingParams, max_tokens: int,
                 eos_ids: Collection[int]) -> AsyncIterator[int]:
        """Yield up to max_tokens sampled ids; the last one is an eos id when generation ended on EOS."""

    @abstractmethod
    def active_kv_caches(self) -> int:
        """Requests whose KV cache is currently held (drops to 0 once every request is finished or cancelled)."""

    @abstractmethod
    async def close(self) -> None:
        """Stop accepting work and free resources."""

    def stats(self) -> dict[str, object]:
        return {
            "in_flight_requests": len(self.in_flight),
            "active_kv_caches": self.active_kv_caches(),
            "requests_total": self.requests_total,
            "tokens_generated_total": self.tokens_generated_total,
        }


class LocalGenerator(TokenGenerator):
    """Runs the whole model with one engine on a single worker thread.

    Every executor call is one step of one request (a prefill chunk, or decode + sample), and the executor
    runs calls in submission order, so concurrent requests interleave step by step instead of queueing behind
    each other. The single thread also satisfies the engine's one-caller-at-a-time contract, and it orders a
    request's cache release after any of its forward calls still running.
    """

    def __init__(self, engine: Engine, prefill_chunk: int = PREFILL_CHUNK):
        super().__init__()
        self.engine = engine
        self.prefill_chunk = prefill_chunk
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="engine")
        # Request ids holding a KV cache: written on the engine thread, read by stats on the event loop.
        self._cached: set[str] = set()
        self._cached_lock = threading.Lock()

    async def generate(self, request_id: str, prompt_tokens: list[int], sampling: SamplingParams, max_tokens: int,
                       eos_ids: Collection[int]) -> AsyncIterator[int]:
        if not prompt_tokens:
            raise ValueError("generation needs at least one prompt token")
        if request_id in self.in_flight:
            raise ValueError(f"request id {request_id!r} is already generating")
        progress = RequestProgress(request_id, len(prompt_tokens), max_tokens)
        self.in_flight[request_id] = progress
        self.requests_total += 1
        sampler = Sampler(sampling)
        try:
            token = await self._prefill(request_id, prompt_tokens, sampler)
            while True:
                progress.generated_tokens += 1
                self.tokens_generated_total += 1
                yield token
                if token in eos_ids or progress.generated_tokens >= max_tokens:
                    return
                token = await self._step(request_id, np.array([token], dtype=np.int64), sampler)
        finally:
            del self.in_flight[request_id]
            await self._release_after_pending_steps(request_id)

    async def _prefill(self, request_id: str, prompt_tokens: list[int], sampler: Sampler) -> int:
        """Feed the prompt in chunks (one executor call each, so other requests keep decoding in between)."""
        tokens = np.asarray(prompt_tokens, dtype=np.int64)
        chunks = [tokens[i:i + self.prefill_chunk] for i in range(0, len(tokens), self.prefill_chunk)]
        for chunk in chunks[:-1]:
            await self._run(self._forward, request_id, chunk)
        return await self._step(request_id, chunks[-1], sampler)

    async def _step(self, request_id: str, tokens: np.ndarray, sampler: Sampler) -> int:
        return await self._run(self._forward_and_sample, request_id, tokens, sampler)

    async def _run(self, fn: Callable[..., T], *args: object) -> T:
        return await asyncio.get_running_loop().run_in_executor(self._executor, fn, *args)

    def _forward(self, request_id: str, tokens: np.ndarray) -> np.ndarray:
        with self._cached_lock:
            self._cached.add(request_id)
        return self.engine.forward(request_id, tokens)  # type: ignore[return-value]

    def _forward_and_sample(self, request_id: str, tokens: np.ndarray, sampler: Sampler) -> int:
        logits = self._forward(request_id, tokens)
        return sampler(logits)

    async def _release_after_pending_steps(self, request_id: str) -> None:
        """Free the request's cache on the engine thread, after any of its forward calls still running there.

        Submitted before anything is awaited, so the release happens even if the caller is cancelled again
        while waiting for it; waiting means that once a response is complete, its cache is gone.
        """
        try:
            release = self._executor.submit(self._release, request_id)
        except RuntimeError:  # executor already shut down: the engine and its caches are going away anyway
            log.debug("not releasing %s: the engine thread has stopped", request_id)
            return
        await asyncio.shield(asyncio.wrap_future(release))

    def _release(self, request_id: str) -> None:
        try:
            self.engine.release(request_id)
        except Exception:
            log.exception("releasing the KV cache of %s failed", request_id)
        finally:
            with self._cached_lock:
                self._cached.discard(request_id)

    def active_kv_caches(self) -> int:
        with self._cached_lock:
            return len(self._cached)

    async def close(self) -> None:
        await asyncio.get_running_loop().run_in_executor(None, self._executor.shutdown, True)
