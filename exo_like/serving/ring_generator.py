"""The origin's side of a request: submit it to the ring's first stage, stream its tokens back, and replay it on
a re-formed ring when the one it ran on breaks.

The node that got the HTTP request (any node) is the request's origin. It sends the prompt to the first stage
(stage.py schedules it among the other requests), the last stage sends each sampled token here, and when the
client stops early (stop string, disconnect) the origin tells the first stage to drop the request. A single
node is a ring of one: the same messages, delivered without the network.

Replay, as Petals' client does it: the origin keeps every token of the request so far. When the ring under it
breaks (a stage is lost, a node joins and every stage re-plans), the request pauses, waits for the cluster's
next agreed plan (up to --request-wait), and submits prompt + generated tokens to it as a new attempt. The new
ring computes their keys and values again and samples on from the next token's index; sampling is a function
of (seed, index) (sampling.py), so greedy and seeded streams continue exactly as they would have. Each attempt
has its own id on the wire, so anything the old ring still sends for the request is ignored.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import secrets
import time
from collections.abc import AsyncIterator, Collection
from dataclasses import dataclass, field, replace
from typing import Awaitable, Callable

from exo_like.cluster.protocol import Error, Message, Release, Submit, Tokens
from exo_like.engines.work import SampleSpec
from exo_like.errors import InvalidRequestError, ServiceUnavailableError, StageFailedError, StageStalledError
from exo_like.serving.generation import RequestProgress, TokenGenerator
from exo_like.serving.sampling import Choice, SamplingParams
from exo_like.serving.stage import Router, StageWorker
from partitioning.plan import Plan

log = logging.getLogger(__name__)

# Error codes a stage reports that are the request's own fault (4xx), not the cluster's.
_CLIENT_ERRORS = {"context_length_exceeded", "duplicate_request"}
# Error codes that mean the ring under the request broke, not the request or an engine: replayed.
REPLAYABLE = {"plan_changed", "node_unreachable"}
REPLAY_SEPARATOR = "~"  # wire id of a replay: "<request id>~<attempt>"
# A retry on the plan that just failed (the origin's view had not changed yet) waits this long first, doubling.
RETRY_PAUSE_SECONDS = 0.05
RETRY_PAUSE_MAX_SECONDS = 1.0

WaitForPlan = Callable[[float | None], Awaitable[Plan]]


class RingLost(Exception):
    """The attempt's ring dropped the request; `lost` names the nodes it lost, when known."""

    def __init__(self, reason: str, lost: tuple[str, ...] = ()):
        super().__init__(reason)
        self.reason, self.lost = reason, lost


@dataclass
class _Attempt:
    """One try of a request on one plan: its id on the wire, and where its tokens and failures arrive."""

    wire_rid: str
    plan: Plan
    queue: asyncio.Queue = field(default_factory=asyncio.Queue)


class RingGenerator(TokenGenerator):
    def __init__(self, node_id: str, router: Router, wait_for_plan: WaitForPlan, stage: StageWorker,
                 names: Callable[[str], str] = str, request_wait: float = 30.0,
                 on_replay: Callable[[], None] | None = None):
        super().__init__()
        self.node_id = node_id
        self.router = router
        self.wait_for_plan = wait_for_plan
        self.stage = stage
        self.names = names
        self.request_wait = request_wait  # how long a broken request waits for a ring to replay on
        self.on_replay = on_replay
        self.replays_total = 0
        self._attempts: dict[str, _Attempt] = {}  # by wire id

    async def generate(self, request_id: str, prompt_tokens: list[int], sampling: SamplingParams, max_tokens: int,
                       eos_ids: Collection[int]) -> AsyncIterator[Choice]:
        if not prompt_tokens:
            raise ValueError("generation needs at least one prompt token")
        if request_id in self.in_flight:
            raise ValueError(f"request id {request_id!r} is already generating")
        progress = self.in_flight[request_id] = RequestProgress(request_id, len(prompt_tokens), max_tokens)
        self.requests_total += 1
        try:
            plan = await self.wait_for_plan(None)  # in flight meanwhile: its instance is not unloaded under it
        except BaseException:
            del self.in_flight[request_id]
            raise
        # Without a seed, a random one: sampling is a function of (seed, token index), see sampling.py.
        seed = sampling.seed if sampling.seed is not None else secrets.randbits(63)
        spec = SampleSpec(replace(sampling, seed=seed % 2**63), max_tokens, tuple(int(t) for t in eos_ids),
                          len(prompt_tokens))
        tokens = [int(t) for t in prompt_tokens]  # the prompt, then every token generated so far
        try:
            for number in itertools.count():
                attempt = self._open(request_id, number, plan)
                finished = False
                try:
                    await self._submit(attempt, tokens, spec)
                    while not finished:
                        choice, finished, cached = await self._next(attempt)
                        if progress.generated_tokens == 0:
                            progress.cached_tokens = cached
                        tokens.append(choice.token)
                        progress.generated_tokens += 1
                        progress.recovering = None
                        self.tokens_generated_total += 1
                        self.throughput.add()
                        yield choice
                    return
                except RingLost as exc:
                    lost = exc
                finally:
                    await self._close(attempt, finished)
                plan = await self._recover(progress, attempt.plan, lost)
        finally:
            del self.in_flight[request_id]

    def _open(self, request_id: str, number: int, plan: Plan) -> _Attempt:
        wire_rid = request_id if number == 0 else f"{request_id}{REPLAY_SEPARATOR}{number}"
        attempt = self._attempts[wire_rid] = _Attempt(wire_rid, plan)
        return attempt

    async def _submit(self, attempt: _Attempt, tokens: list[int], spec: SampleSpec) -> None:
        """Everything known so far to the plan's first stage: it computes what it lacks and samples on."""
        first = attempt.plan.stages[0].node_id
        try:
            await self.router.send(first, Submit(attempt.wire_rid, self.node_id, attempt.plan.digest, tuple(tokens),
                                                 spec))
        except (ConnectionError, OSError) as exc:
            raise RingLost(f"the first stage {self._name(first)} is unreachable: {exc}", (first,)) from exc

    @staticmethod
    async def _next(attempt: _Attempt) -> tuple[Choice, bool, int]:
        """The attempt's next (token, last, prompt tokens from the prefix cache); raises what ended it."""
        item = await attempt.queue.get()
        if isinstance(item, Exception):
            raise item
        return item

    async def _close(self, attempt: _Attempt, finished: bool) -> None:
        del self._attempts[attempt.wire_rid]
        if not finished:
            await self._release(attempt.plan, attempt.wire_rid)

    async def _recover(self, progress: RequestProgress, failed: Plan, lost: RingLost) -> Plan:
        """Wait for a ring to replay the request on; raise if none comes within --request-wait."""
        if progress.recovering is None:  # a new pause (not a retry within one): the wait starts now
            progress.recovery_deadline, progress.retries = time.monotonic() + self.request_wait, 0
            progress.replays += 1
            self.replays_total += 1
            if self.on_replay is not None:
                self.on_replay()
            log.info("node %s: request %s paused after %d tokens (%s); replaying on the next ring", self.node_id,
                     progress.request_id, progress.generated_tokens, lost.reason)
        else:
            log.info("node %s: request %s: the replay on plan %s failed too (%s); trying again", self.node_id,
                     progress.request_id, failed.digest, lost.reason)
        progress.recovering = lost.reason
        progress.lost_nodes = tuple(dict.fromkeys(progress.lost_nodes + tuple(self.names(n) for n in lost.lost)))
        remaining = progress.recovery_deadline - time.monotonic()
        try:
            if remaining <= 0:
                raise ServiceUnavailableError(f"no ring re-formed within {self.request_wait:g} s (--request-wait)",
                                              code="plan_unavailable")
            plan = await self.wait_for_plan(remaining)
        except ServiceUnavailableError as exc:
            raise ServiceUnavailableError(f"{lost.reason}; the request could not be resumed on the remaining "
                                          f"nodes: {exc.message}", code=exc.code) from exc
        if plan.digest == failed.digest:
            # This node has not seen the change yet (another stage re-planned first): pause before trying again.
            progress.retries += 1
            await asyncio.sleep(min(RETRY_PAUSE_MAX_SECONDS, RETRY_PAUSE_SECONDS * 2 ** (progress.retries - 1)))
        return plan

    async def _release(self, plan: Plan, wire_rid: str) -> None:
        """The first stage frees the request's KV blocks; the last, its token history (penalties)."""
        for node_id in dict.fromkeys((plan.stages[0].node_id, plan.stages[-1].node_id)):
            try:
                await self.router.send(node_id, Release(wire_rid))
            except (ConnectionError, OSError):
                pass  # the stage is gone, and what it held of the request with it

    def handle(self, message: Message) -> None:
        if isinstance(message, Tokens):
            for token in message.tokens:
                attempt = self._attempts.get(token.rid)
                if attempt is not None:
                    attempt.queue.put_nowait((Choice(token.token, token.logprob, token.top_logprobs), token.done,
                                              token.cached))
        elif isinstance(message, Error):
            attempt = self._attempts.get(message.rid)
            if attempt is not None:
                attempt.queue.put_nowait(_error(message))

    def members_changed(self, live_node_ids: Collection[str]) -> None:
        """Replay every request whose ring lost a node."""
        for attempt in self._attempts.values():
            missing = tuple(n for n in dict.fromkeys(attempt.plan.member_ids) if n not in live_node_ids)
            if missing:
                names = ", ".join(self._name(n) for n in missing)
                attempt.queue.put_nowait(RingLost(f"node {names} left the cluster during the request", missing))

    def fail_stalled(self, step_seconds: Callable[[str], float], limit: float) -> None:
        """Fail every request whose ring has a stage that has been inside one step for more than `limit`
        seconds. Its engine is most likely hung while the node itself (and so its link) stays alive."""
        for attempt in self._attempts.values():
            for node_id in dict.fromkeys(attempt.plan.member_ids):
                seconds = step_seconds(node_id)
                if seconds > limit:
                    attempt.queue.put_nowait(StageStalledError(
                        f"node {self._name(node_id)} has been inside one step of its layers for {seconds:.0f} s, "
                        f"over the {limit:g} s limit (--step-timeout): its engine looks hung, so the request was "
                        "stopped; restart that node if this repeats", code="stage_stalled"))
                    break

    def _name(self, node_id: str) -> str:
        return f"{self.names(node_id)} ({node_id})"

    def recovering(self) -> dict[str, int]:
        """Requests paused for a replay, by the node they lost ("" when a re-plan, not a loss, broke their ring)."""
        counts: dict[str, int] = {}
        for progress in self.in_flight.values():
            if progress.recovering is not None:
                for name in progress.lost_nodes[-1:] or ("",):
                    counts[name] = counts.get(name, 0) + 1
        return counts

    def active_kv_caches(self) -> int:
        return self.stage.active_requests()

    def stats(self) -> dict[str, object]:
        return {**super().stats(), "replays_total": self.replays_total}

    async def close(self, reason: str = "the node is shutting down", code: str = "shutting_down") -> None:
        for attempt in self._attempts.values():
            attempt.queue.put_nowait(ServiceUnavailableError(reason, code=code))

    def expects(self, wire_rid: str) -> bool:
        """Whether a request of this generator runs under that id on the wire (its tokens and errors come here)."""
        return wire_rid in self._attempts


def _error(message: Error) -> Exception:
    if message.code in REPLAYABLE:
        return RingLost(message.message)
    if message.code in _CLIENT_ERRORS:
        return InvalidRequestError(message.message, code=message.code)
    if message.code == "stage_failed":
        return StageFailedError(message.message, code=message.code)
    return ServiceUnavailableError(message.message, code=message.code)

