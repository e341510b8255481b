"""Inference across the ring of stages.

The requesting node (origin) sends the prompt to the first stage. Each stage runs its layers and passes the
hidden states to the next; the last stage samples, sends the token to the origin (to stream) and to the first
stage (next step). When the last stage sees EOS or max_tokens it tells every stage to release the request;
when the origin stops early (stop string, client gone) it does the same. A single node is a ring of one.

Messages (msgpack maps, see wire.py):
  forward  {rid, digest, origin, meta?, tokens | acts, sample}   -> a stage
  token    {rid, token, done}                                    -> the origin
  error    {rid, message, code}                                  -> the origin
  release  {rid}                                                 -> every stage
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import OrderedDict
from collections.abc import AsyncIterator, Collection
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Awaitable, Callable, Protocol

import numpy as np

from exo_like.activations import Activations
from exo_like.engines.base import Engine
from exo_like.errors import ServiceUnavailableError, StageFailedError, StageStalledError
from exo_like.generation import RequestProgress, TokenGenerator
from exo_like.meter import RateMeter, RecentMedian
from exo_like.plan import Plan
from exo_like.sampling import Sampler, SamplingParams

log = logging.getLogger(__name__)

PREFILL_CHUNK = 512
_REMEMBERED_FINISHED = 4096  # released request ids kept to drop their late messages


class Router(Protocol):
    node_id: str

    async def send(self, node_id: str, message: dict[str, Any]) -> None:
        """Deliver to a node (this one included). Raises ConnectionError if it cannot be reached."""


@dataclass
class _StageRequest:
    origin: str
    digest: str
    sampler: Sampler
    max_tokens: int
    eos: frozenset[int]
    generated: int = 0


class StageWorker:
    """This node's part of every request: run the shard, pass hidden states on, sample on the last stage.

    All engine work goes through one single-thread executor: it serialises calls (the engine contract) and
    runs a request's release after any of its forward calls already queued.
    """

    def __init__(self, node_id: str, router: Router, executor: ThreadPoolExecutor, prefill_chunk: int = PREFILL_CHUNK):
        self.node_id = node_id
        self.router = router
        self.executor = executor
        self.prefill_chunk = prefill_chunk
        self.engine: Engine | None = None
        self.plan: Plan | None = None
        self._requests: dict[str, _StageRequest] = {}
        self._finished: OrderedDict[str, None] = OrderedDict()
        self._releasing: set[str] = set()  # released here, the engine thread not yet done freeing the cache
        self.tokens_sampled = 0
        self._step_started: float | None = None  # monotonic time the engine thread began its current step
        self.throughput = RateMeter()  # generated tokens that passed through this stage, recently
        self.decode_step_seconds = RecentMedian()  # engine time of recent one-position steps (sampling included)
        self._notices: set[asyncio.Task] = set()  # errors on their way to origins (strong references)

    def activate(self, plan: Plan | None, engine: Engine | None) -> None:
        """Serve `plan` with `engine` (already holding this node's shard of it).

        Requests of the previous plan end here: their caches are freed and each origin is told at once, so a
        request whose ring re-formed (a node joined, or this node's view changed) fails clearly, not silently."""
        for rid, state in list(self._requests.items()):
            self._release(rid)
            self._notify_origin(rid, state.origin, f"the cluster's plan changed during the request (node "
                                f"{self.node_id} re-planned: a node joined or left); retry once the ring is ready",
                                "plan_changed")
        self.plan, self.engine = plan, engine
        self.decode_step_seconds = RecentMedian()  # steps of another layer range would mislead

    def step_seconds(self) -> float:
        """How long the engine has been inside the step it is running now (0 when it is not running one)."""
        started = self._step_started
        return 0.0 if started is None else time.monotonic() - started

    def active_requests(self) -> int:
        """Requests whose KV cache this node may still hold: running, or released with the free still queued."""
        return len(self._requests.keys() | self._releasing)

    async def handle(self, message: dict[str, Any]) -> None:
        kind = message["type"]
        if kind == "forward":
            await self._on_forward(message)
        elif kind == "release":
            self._release(str(message["rid"]))

    async def _on_forward(self, message: dict[str, Any]) -> None:
        rid = str(message["rid"])
        if rid in self._finished:
            return
        plan, engine = self.plan, self.engine
        if plan is None or engine is None or message["digest"] != plan.digest:
            await self._fail(rid, str(message["origin"]), "the cluster's plan changed during the request",
                             "plan_changed")
            return
        state = self._requests.get(rid)
        if state is None:
            state = self._requests[rid] = _new_state(message, plan.digest)
        index = plan.stage_index(self.node_id)
        try:
            for chunk, sample in self._chunks(message, index == 0):
                if not await self._run_chunk(rid, state, plan, index, chunk, sample, message.get("meta")):
                    return
        except Exception as exc:  # engine failure: tell the origin, free the request everywhere
            log.exception("node %s: stage failed on request %s", self.node_id, rid)
            await self._fail(rid, state.origin, f"stage on node {self.node_id} failed: {exc}", "stage_failed")

    def _chunks(self, message: dict[str, Any], is_first: bool) -> list[tuple[np.ndarray | Activations, bool]]:
        if "acts" in message:
            return [(Activations.from_wire(message["acts"]), bool(message["sample"]))]
        tokens = np.asarray(message["tokens"], dtype=np.int64)
        pieces = [tokens[i:i + self.prefill_chunk] for i in range(0, len(tokens), self.prefill_chunk)]
        return [(piece, bool(message["sample"]) and i == len(pieces) - 1) for i, piece in enumerate(pieces)]

    async def _run_chunk(self, rid: str, state: _StageRequest, plan: Plan, index: int,
                         chunk: np.ndarray | Activations, sample: bool, meta: dict[str, Any] | None) -> bool:
        is_last = index == len(plan.stages) - 1
        loop = asyncio.get_running_loop()
        result = await loop.run_in_executor(self.executor, self._compute, rid, chunk, is_last and sample, state)
        if result is None:  # released while queued
            return False
        if sample:  # this chunk ends at the position a token is sampled from: one generated token passed here
            self.throughput.add()
        if not is_last:
            forward = {"type": "forward", "rid": rid, "digest": plan.digest, "origin": state.origin,
                       "acts": result.to_wire(), "sample": sample}
            if meta is not None:
                forward["meta"] = meta
            await self._send(plan.stages[index + 1].node_id, forward, rid, state)
            return True
        if sample:
            await self._emit(rid, state, plan, int(result))
        return True

    def _compute(self, rid: str, chunk: np.ndarray | Activations, sample: bool,
                 state: _StageRequest) -> Activations | np.ndarray | int | None:
        """Engine thread: forward (and sample on the last stage), unless the request was released meanwhile."""
        if rid in self._finished or self.engine is None:
            return None
        started = self._step_started = time.monotonic()
        try:
            out = self.engine.forward(rid, chunk)
            result = state.sampler(out) if sample else out
        finally:
            self._step_started = None
        if chunk.shape[0] == 1:  # a decode step: one position, one generated token
            self.decode_step_seconds.add(time.monotonic() - started)
        return result

    async def _emit(self, rid: str, state: _StageRequest, plan: Plan, token: int) -> None:
        state.generated += 1
        self.tokens_sampled += 1
        done = token in state.eos or state.generated >= state.max_tokens
        token_message = {"type": "token", "rid": rid, "token": token, "done": done}
        if done:
            # Release first: every stage (the origin's too) then has its free queued before the origin hears
            # the request is done, so the origin can end the response with its own cache already freed.
            await release_everywhere(self.router, rid, plan)
            await self._send(state.origin, token_message, rid, state)
            return
        # The next step first: it is on the critical path, streaming the token to the origin is not.
        await self._send(plan.stages[0].node_id, {"type": "forward", "rid": rid, "digest": plan.digest,
                                                  "origin": state.origin, "tokens": [token], "sample": True},
                         rid, state)
        await self._send(state.origin, token_message, rid, state)

    async def _send(self, node_id: str, message: dict[str, Any], rid: str, state: _StageRequest) -> None:
        try:
            await self.router.send(node_id, message)
        except (ConnectionError, OSError) as exc:
            await self._fail(rid, state.origin, f"node {node_id} is unreachable: {exc}", "node_unreachable")

    async def _fail(self, rid: str, origin: str, reason: str, code: str) -> None:
        await self._send_error(rid, origin, reason, code)
        if self.plan is not None:
            await release_everywhere(self.router, rid, self.plan)
        else:
            self._release(rid)

    async def _send_error(self, rid: str, origin: str, reason: str, code: str) -> None:
        try:
            await self.router.send(origin, {"type": "error", "rid": rid, "message": reason, "code": code})
        except (ConnectionError, OSError):
            pass  # the origin is gone too: nobody is waiting

    def _notify_origin(self, rid: str, origin: str, reason: str, code: str) -> None:
        task = asyncio.ensure_future(self._send_error(rid, origin, reason, code))
        self._notices.add(task)
        task.add_done_callback(self._notices.discard)

    async def cache_freed(self, rid: str) -> None:
        """Return once this node's engine has freed the request's cache, if a free of it is queued."""
        if rid in self._releasing:
            # The engine thread runs its work in order: a no-op queued now finishes after that free.
            try:
                await asyncio.get_running_loop().run_in_executor(self.executor, _nothing)
            except RuntimeError:  # executor shut down: the node is stopping and its engine with it
                pass

    def _release(self, rid: str) -> None:
        self._finish(rid)
        engine = self.engine
        if engine is None:
            return
        self._releasing.add(rid)  # before submitting: the free may finish before submit returns
        try:
            freed = self.executor.submit(engine.release, rid)
        except RuntimeError:  # executor shut down: the engine is going away
            self._releasing.discard(rid)
            return
        # Runs on the engine thread; set.discard is a single atomic operation under the GIL.
        freed.add_done_callback(lambda _: self._releasing.discard(rid))

    def _finish(self, rid: str) -> None:
        self._requests.pop(rid, None)
        self._finished[rid] = None
        while len(self._finished) > _REMEMBERED_FINISHED:
            self._finished.popitem(last=False)


def _nothing() -> None:
    pass


async def release_everywhere(router: Router, rid: str, plan: Plan) -> None:
    """Tell every stage of the plan to drop the request (best effort: a departed node's caches went with it)."""
    for node_id in dict.fromkeys(plan.node_ids):
        try:
            await router.send(node_id, {"type": "release", "rid": rid})
        except (ConnectionError, OSError):
            pass


def _new_state(message: dict[str, Any], digest: str) -> _StageRequest:
    meta = message.get("meta") or {}
    sampling = meta.get("sampling") or {}
    return _StageRequest(
        origin=str(message["origin"]),
        digest=digest,
        sampler=Sampler(SamplingParams(float(sampling.get("temperature", 1.0)), float(sampling.get("top_p", 1.0)),
                                       int(sampling.get("top_k", 0)), sampling.get("seed"))),
        max_tokens=int(meta.get("max_tokens", 1 << 30)),
        eos=frozenset(int(t) for t in meta.get("eos", ())),
    )


@dataclass
class _Pending:
    plan: Plan
    queue: asyncio.Queue = field(default_factory=asyncio.Queue)


class RingGenerator(TokenGenerator):
    """The origin's side: start a request on the ring and stream its tokens back."""

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
        finished = False
        try:
            await self.router.send(plan.stages[0].node_id, {
                "type": "forward", "rid": request_id, "digest": plan.digest, "origin": self.node_id,
                "tokens": [int(t) for t in prompt_tokens], "sample": True,
                "meta": {"sampling": {"temperature": sampling.temperature, "top_p": sampling.top_p,
                                      "top_k": sampling.top_k, "seed": sampling.seed},
                         "max_tokens": max_tokens, "eos": [int(t) for t in eos_ids]},
            })
            while not finished:
                item = await pending.queue.get()
                if isinstance(item, Exception):
                    raise item
                token, finished = item
                progress.generated_tokens += 1
                self.tokens_generated_total += 1
                self.throughput.add()
                yield token
            await self.stage.cache_freed(request_id)  # the response ends with this node's cache freed
        except ConnectionError as exc:
            raise ServiceUnavailableError(f"the first stage is unreachable: {exc}") from exc
        finally:
            del self._pending[request_id]
            del self.in_flight[request_id]
            if not finished:
                await release_everywhere(self.router, request_id, plan)

    async def handle(self, message: dict[str, Any]) -> None:
        pending = self._pending.get(str(message["rid"]))
        if pending is None:
            return  # finished or cancelled already
        if message["type"] == "token":
            pending.queue.put_nowait((int(message["token"]), bool(message["done"])))
        elif message["type"] == "error":
            code = str(message.get("code") or "stage_failed")
            error_class = StageFailedError if code == "stage_failed" else ServiceUnavailableError
            pending.queue.put_nowait(error_class(str(message["message"]), code=code))

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
