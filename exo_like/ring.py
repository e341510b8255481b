"""The origin's side of a request: submit it to the ring's first stage and stream its tokens back.

The node that got the HTTP request (any node) is the request's origin. It sends the prompt to the first stage
(stage.py schedules it among the other requests), the last stage sends each sampled token here, and when the
client stops early (stop string, disconnect) the origin tells the first stage to drop the request. A single
node is a ring of one: the same messages, delivered without the network.
"""

from __future__ import annotations

import asyncio
import logging
import secrets
from collections.abc import AsyncIterator, Collection
from dataclasses import dataclass, field
from typing import Awaitable, Callable

from exo_like.errors import ServiceUnavailableError, StageFailedError, StageStalledError, InvalidRequestError
from exo_like.generation import RequestProgress, TokenGenerator
from exo_like.plan import Plan
from exo_like.protocol import Error, Message, Release, SampleSpec, Submit, Tokens
from exo_like.sampling import SamplingParams
from exo_like.stage import Router, StageWorker

log = logging.getLogger(__name__)

# Error codes a stage reports that are the request's own fault (4xx), not the cluster's.
_CLIENT_ERRORS = {"context_length_exceeded", "duplicate_request"}


@dataclass
class _Pending:
    plan: Plan
    queue: asyncio.Queue = field(default_factory=asyncio.Queue)


class RingGenerator(TokenGenerator):
    def __init__(self, node_id: str, router: Router, wait_for_plan: Callable[[], Awaitable[Plan]],
                 stage: StageWorker, names: Callable[[str], str] = str):
        super().__init__()
        self.node_id = node_id
        self.router = router
        self.wait_for_plan = wait_for_plan
        self.stage = stage
        self.names = names
        self._pending: dict[str, _Pending] = {}

    async def generate(self, request_id: str, prompt_tokens: list[int], sampling: SamplingParams, max_tokens: int,
                       eos_ids: Collection[int]) -> AsyncIterator[int]:
        if not prompt_tokens:
            raise ValueError("generation needs at least one prompt token")
        if request_id in self._pending:
            raise ValueError(f"request id {request_id!r} is already generating")
        plan = await self.wait_for_plan()
        pending = self._pending[request_id] = _Pending(plan)
        progress = self.in_flight[request_id] = RequestProgress(request_id, len(prompt_tokens), max_tokens)
        self.requests_total += 1
        # Without a seed, a random one: sampling is a function of (seed, token index), see sampling.py.
        seed = sampling.seed if sampling.seed is not None else secrets.randbits(63)
        spec = SampleSpec(sampling.temperature, sampling.top_p, sampling.top_k, seed % 2**63, max_tokens,
                          tuple(int(t) for t in eos_ids), len(prompt_tokens))
        finished = False
        try:
            await self.router.send(plan.stages[0].node_id, Submit(request_id, self.node_id, plan.digest,
                                                                  tuple(int(t) for t in prompt_tokens), spec))
            while not finished:
                item = await pending.queue.get()
                if isinstance(item, Exception):
                    raise item
                token, finished = item
                progress.generated_tokens += 1
                self.tokens_generated_total += 1
                self.throughput.add()
                yield token
        except ConnectionError as exc:
            raise ServiceUnavailableError(f"the first stage is unreachable: {exc}") from exc
        finally:
            del self._pending[request_id]
            del self.in_flight[request_id]
            if not finished:
                await self._release(plan, request_id)

    async def _release(self, plan: Plan, request_id: str) -> None:
        try:
            await self.router.send(plan.stages[0].node_id, Release(request_id))
        except (ConnectionError, OSError):
            pass  # the first stage is gone, and the request's KV blocks with it

    def handle(self, message: Message) -> None:
        if isinstance(message, Tokens):
            for token in message.tokens:
                pending = self._pending.get(token.rid)
                if pending is not None:
                    pending.queue.put_nowait((token.token, token.done))
        elif isinstance(message, Error):
            pending = self._pending.get(message.rid)
            if pending is not None:
                pending.queue.put_nowait(_error(message))

    def members_changed(self, live_node_ids: Collection[str]) -> None:
        """Fail at once every request whose ring lost a node."""
        for pending in self._pending.values():
            missing = [n for n in pending.plan.node_ids if n not in live_node_ids]
            if missing:
                names = ", ".join(f"{self.names(n)} ({n})" for n in missing)
                pending.queue.put_nowait(ServiceUnavailableError(
                    f"node {names} left the cluster during the request; retry once the ring has re-formed",
                    code="node_lost"))

    def fail_stalled(self, step_seconds: Callable[[str], float], limit: float) -> None:
        """Fail every request whose ring has a stage that has been inside one step for more than `limit`
        seconds. Its engine is most likely hung while the node itself (and so its link) stays alive."""
        for pending in self._pending.values():
            for node_id in dict.fromkeys(pending.plan.node_ids):
                seconds = step_seconds(node_id)
                if seconds > limit:
                    pending.queue.put_nowait(StageStalledError(
                        f"node {self.names(node_id)} ({node_id}) has been inside one step of its layers for "
                        f"{seconds:.0f} s, over the {limit:g} s limit (--step-timeout): its engine looks hung, so "
                        f"the request was stopped; restart that node if this repeats", code="stage_stalled"))
                    break

    def active_kv_caches(self) -> int:
        return self.stage.active_requests()

    async def close(self) -> None:
        for pending in self._pending.values():
            pending.queue.put_nowait(ServiceUnavailableError("the node is shutting down", code="shutting_down"))


def _error(message: Error) -> Exception:
    if message.code in _CLIENT_ERRORS:
        return InvalidRequestError(message.message, code=message.code)
    if message.code == "stage_failed":
        return StageFailedError(message.message, code=message.code)
    return ServiceUnavailableError(message.message, code=message.code)
