"""The token-level generation loop, behind one small interface.

`TokenGenerator.generate` turns prompt tokens into a stream of sampled tokens. The implementation is the
ring of stages (exo_like.serving.ring_generator.RingGenerator); a single node is a ring of one. The HTTP layer above only sees
this interface.

Closing the async generator (the client went away, a stop string matched, an error) always frees the
request's KV cache: callers should iterate it inside `contextlib.aclosing`.
"""

from __future__ import annotations

import logging
import time
from abc import ABC, abstractmethod
from collections.abc import AsyncIterator, Collection
from dataclasses import dataclass, field
from typing import TypeVar

from exo_like.meter import RateMeter
from exo_like.serving.sampling import Choice, SamplingParams

log = logging.getLogger(__name__)

T = TypeVar("T")


@dataclass
class RequestProgress:
    """What a dashboard shows about one in-flight request."""

    request_id: str
    prompt_tokens: int
    max_tokens: int
    generated_tokens: int = 0
    started: float = field(default_factory=time.time)
    replays: int = 0  # times the request was resumed on a re-formed ring
    recovering: str | None = None  # why it is paused, waiting for a ring to replay on (None: it is not)
    lost_nodes: tuple[str, ...] = ()  # names of the nodes whose loss made it replay, oldest first
    recovery_deadline: float = 0.0  # monotonic time by which a ring must have re-formed under it
    retries: int = 0  # attempts within the current pause on the plan that had just failed
    cached_tokens: int = 0  # prompt tokens the first stage found in its prefix cache (known with the first token)

    def to_json(self) -> dict[str, object]:
        return {
            "id": self.request_id,
            "prompt_tokens": self.prompt_tokens,
            "generated_tokens": self.generated_tokens,
            "max_tokens": self.max_tokens,
            "age_seconds": round(time.time() - self.started, 3),
            "replays": self.replays,
            "recovering": self.recovering,
            "lost_nodes": list(self.lost_nodes),
        }


class TokenGenerator(ABC):
    """Prompt tokens in, sampled tokens out; one request per call, any number of requests concurrently."""

    def __init__(self) -> None:
        self.in_flight: dict[str, RequestProgress] = {}
        self.tokens_generated_total = 0
        self.requests_total = 0
        self.throughput = RateMeter()  # tokens streamed to this node's clients, recently

    @abstractmethod
    def generate(self, request_id: str, prompt_tokens: list[int], sampling: SamplingParams, max_tokens: int,
                 eos_ids: Collection[int]) -> AsyncIterator[Choice]:
        """Yield up to max_tokens sampled tokens (with their log-probabilities when `sampling` asks for them); the
        last one is an eos id when generation ended on EOS."""

    def cached_tokens(self, request_id: str) -> int:
        """The prompt tokens of an in-flight request that came from the prefix cache (0 once it is over)."""
        progress = self.in_flight.get(request_id)
        return progress.cached_tokens if progress is not None else 0

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
