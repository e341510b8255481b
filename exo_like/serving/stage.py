"""This node's stage of the ring: a loop that runs one batch of work per engine step.

The first stage schedules (scheduler.py): each step takes the ready decode tokens and prompt chunks of many
requests, runs them through its layers at once and sends the hidden states on as one Forward. A later stage runs
whatever batches have arrived (several at once when they queued up while it was busy) and passes them on; the
last stage samples each request's token (per request: its own temperature, top-p, top-k, seed), sends every
token back to the first stage (the next step's input) and to each request's origin (to stream).

Stages other than the first keep no per-request state: each item carries its KV block table and positions, and
every stage runs the first stage's batches in the order it sent them, so a block the first stage frees and hands
to another request is rewritten only after the last read of its previous contents.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import deque
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Protocol

import numpy as np

from exo_like.cluster.protocol import (Error, Forward, Message, Release, SampleSpec, Sampled, SampledToken, Submit,
                                       Tokens)
from exo_like.engines.activations import Activations
from exo_like.engines.base import Engine
from exo_like.engines.work import BLOCK_SIZE, WorkItem
from exo_like.errors import ExoLikeError
from exo_like.meter import RateMeter, RecentMedian
from exo_like.serving.grammar import Constraint, GrammarVocabulary
from exo_like.serving.sampling import TokenHistory, choose
from exo_like.serving.speculative import verify
from exo_like.serving.scheduler import Scheduler, SchedulerLimits, Step
from partitioning.plan import Plan

log = logging.getLogger(__name__)


class Router(Protocol):
    node_id: str

    async def send(self, node_id: str, message: Message) -> None:
        """Deliver to a node (this one included). Raises ConnectionError if it cannot be reached."""


@dataclass(frozen=True)
class RingResources:
    kv_blocks: int  # the smallest KV pool of the plan's stages: what the first stage may hand out
    pipeline_depth: int  # batches worth keeping in flight (stages on separate machines)
    kv_window_blocks: int | None = None  # the same for the sliding-window layers' pools (None: the model has none)


class StepAbandoned(Exception):
    """The step's plan was replaced before the engine thread reached it."""


@dataclass
class _Work:
    """One engine step's input: the items and their rows (token ids on the first stage, else hidden states)."""

    plan: Plan
    items: list[WorkItem]
    inputs: np.ndarray | Activations


@dataclass
class SamplerState:
    """A request's sampling state at the last stage: its tokens (for the penalties) and its grammar's matcher."""

    history: TokenHistory | None
    constraint: Constraint | None


class StageWorker:
    def __init__(self, node_id: str, router: Router, executor: ThreadPoolExecutor,
                 resources: Callable[[Plan], RingResources | None], limits: SchedulerLimits = SchedulerLimits(),
                 on_step: Callable[[float, int], None] | None = None,
                 grammar_vocabulary: Callable[[], GrammarVocabulary | None] = lambda: None):
        self.node_id = node_id
        self.router = router
        self.executor = executor
        self.resources = resources
        self.limits = limits
        self.on_step = on_step  # (seconds, rows) of every step, for /metrics
        self.grammar_vocabulary = grammar_vocabulary  # the served model's tokens, for constrained requests
        self.engine: Engine | None = None
        self.plan: Plan | None = None
        self.scheduler: Scheduler | None = None  # the first stage's, once the ring's KV capacity is known
        self._submitted: list[Submit] = []  # arrived before the scheduler could be made
        self._inbox: deque[Forward] = deque()  # batches from the previous stage, not run yet
        self.sampler_states: dict[str, SamplerState] = {}  # last stage: what stateful requests' sampling reads
        self._wake = asyncio.Event()
        self._loop_task: asyncio.Task | None = None
        self._notices: set[asyncio.Task] = set()  # errors on their way to origins (strong references)
        self._step_started: float | None = None  # monotonic time the engine thread began its current step
        self._last_step = 0.0
        self.kv_used = 0  # blocks the ring's requests and prefix cache hold (the first stage's count)
        # Prefix-cache lookups and hits (tokens), preemptions, proposed and kept draft tokens, drafts: schedulers
        # before this one
        self._totals = (0, 0, 0, 0, 0, 0)
        self.throughput = RateMeter()  # generated tokens that passed through this stage, recently
        self.decode_step_seconds = RecentMedian()  # engine time of recent decode-only steps (sampling included)

    # -- plan -----------------------------------------------------------------------------------------------

    def activate(self, plan: Plan | None, engine: Engine | None) -> None:
        """Serve `plan` with `engine` (already holding this node's shard and KV pool).

        Requests of the previous plan end here, each origin told at once: the layers they ran on moved."""
        origins: dict[str, str] = {}
        if self.scheduler is not None:
            origins.update((seq.rid, seq.origin) for seq in self.scheduler.drain())
            self._totals = tuple(total + now for total, now in zip(self._totals, self._scheduler_totals()))
        origins.update((s.rid, s.origin) for s in self._submitted)
        origins.update((item.rid, item.origin) for frame in self._inbox for item in frame.items)
        for rid, origin in origins.items():
            self._notify(rid, origin, f"the cluster's plan changed during the request (node {self.node_id} "
                         "re-planned: a node joined or left); retry once the ring is ready", "plan_changed")
        self._submitted.clear()
        self._inbox.clear()
        self.sampler_states.clear()  # the requests replay on the new plan, each bringing its history again
        self.scheduler, self.plan, self.engine = None, plan, engine
        self.kv_used = 0
        self.decode_step_seconds = RecentMedian()  # steps of another layer range would mislead
        if self._loop_task is None:
            self._loop_task = asyncio.ensure_future(self._run())
        self.wake()

    def wake(self) -> None:
        """Look for work now (a message arrived, or what the ring can hold became known)."""
        self._wake.set()

    async def close(self) -> None:
        if self._loop_task is not None:
            self._loop_task.cancel()

    # -- messages -------------------------------------------------------------------------------------------

    def handle(self, message: Message) -> None:
        if isinstance(message, Submit):
            self._on_submit(message)
        elif isinstance(message, Forward):
            self._on_forward(message)
        elif isinstance(message, Sampled):
            self._on_sampled(message)
        elif isinstance(message, Release):
            self.sampler_states.pop(message.rid, None)
            if self.scheduler is not None:
                self.scheduler.release(message.rid)
            self._submitted = [s for s in self._submitted if s.rid != message.rid]
        self.wake()

    def _on_submit(self, message: Submit) -> None:
        plan = self.plan
        if plan is None or message.digest != plan.digest or plan.stage_index(self.node_id) != 0:
            self._notify(message.rid, message.origin, "the cluster's plan changed before the request started; "
                         "retry once the ring is ready", "plan_changed")
        elif self.scheduler is None:
            self._submitted.append(message)
        else:
            self.scheduler.submit(message.rid, message.origin, message.tokens, message.sample)

    def _on_forward(self, message: Forward) -> None:
        plan = self.plan
        if plan is None or message.digest != plan.digest:
            for rid, origin in {(item.rid, item.origin) for item in message.items}:
                self._notify(rid, origin, "the cluster's plan changed during the request", "plan_changed")
            return
        if not plan.stage_index(self.node_id):  # the first stage schedules, it never runs a batch from a peer
            log.warning("node %s: dropped a batch of %d rows sent to it as if it were a later stage of plan %s",
                        self.node_id, message.hidden.shape[0], plan.digest)
            return
        self.kv_used = message.kv_used
        self._inbox.append(message)

    def _on_sampled(self, message: Sampled) -> None:
        if isinstance(message, Tokens):
            return  # an origin's copy: not for the stage
        if self.scheduler is None or self.plan is None or message.digest != self.plan.digest:
            return
        by_request: dict[str, list[SampledToken]] = {}
        for token in message.tokens:  # (a verified draft gives a request several, in order)
            by_request.setdefault(token.rid, []).append(token)
        for rid, tokens in by_request.items():
            self.scheduler.on_sampled(rid, [token.token for token in tokens], tokens[-1].done)

    # -- the step loop --------------------------------------------------------------------------------------

    async def _run(self) -> None:
        while True:
            await self._wake.wait()
            self._wake.clear()
            try:
                while (work := self._next_work()) is not None:
                    await self._run_step(work)
            except asyncio.CancelledError:
                raise
            except Exception:  # a bug here must not stop the stage for every later request
                log.exception("node %s: stage loop failed", self.node_id)

    def _next_work(self) -> _Work | None:
        plan, engine = self.plan, self.engine
        if plan is None or engine is None:
            return None
        if plan.stage_index(self.node_id) == 0:
            step = self._schedule(plan)
            return None if step is None else _Work(plan, step.items, step.tokens)
        return self._merge_inbox(plan)

    def _schedule(self, plan: Plan) -> Step | None:
        if self.scheduler is None:
            resources = self.resources(plan)
            if resources is None:
                return None  # some stage has not announced its KV pool yet: its announcement wakes us
            self.scheduler = Scheduler(resources.kv_blocks, self.limits, resources.pipeline_depth,
                                       self.engine is None or self.engine.on_cpu, attention_scale(self.engine),
                                       self.engine.kv_window if self.engine is not None else None,
                                       resources.kv_window_blocks)
            for message in self._submitted:
                self.scheduler.submit(message.rid, message.origin, message.tokens, message.sample)
            self._submitted.clear()
        step = self.scheduler.schedule()
        for failure in self.scheduler.failures:
            self._notify(failure.rid, failure.origin, failure.message, failure.code)
        self.scheduler.failures.clear()
        self.kv_used = self.scheduler.pool.used
        return step

    def _merge_inbox(self, plan: Plan) -> _Work | None:
        """The oldest arrived batch, joined by the ones queued behind it while they fit one step: their rows go
        through the layers together. Batches whose rows would write the same KV slot stay apart (the later one
        reuses a block the earlier one's request gave up; it must write after it)."""
        if not self._inbox:
            return None
        frames = [self._inbox.popleft()]
        rows = frames[0].hidden.shape[0]
        written = set(_written_slots(frames[0].items)) if self._inbox else set()
        while self._inbox:
            frame = self._inbox[0]
            slots = _written_slots(frame.items)
            limit = self.limits.for_device(self.engine is None or self.engine.on_cpu).max_batch_tokens
            fits = rows + frame.hidden.shape[0] <= limit
            if not fits or frame.hidden.dtype != frames[0].hidden.dtype or not written.isdisjoint(slots):
                break
            frames.append(self._inbox.popleft())
            rows += frame.hidden.shape[0]
            written.update(slots)
        items = [item for frame in frames for item in frame.items]
        if len(frames) == 1:
            return _Work(plan, items, frames[0].hidden)
        data = b"".join(frame.hidden.data for frame in frames)
        return _Work(plan, items, Activations(frames[0].hidden.dtype, (rows, frames[0].hidden.shape[1]), data))

    async def _run_step(self, work: _Work) -> None:
        index = work.plan.stage_index(self.node_id)
        is_last = index == len(work.plan.stages) - 1
        loop = asyncio.get_running_loop()
        try:
            result = await loop.run_in_executor(self.executor, self._compute, work, is_last)
        except Exception as exc:  # engine failure: every request of the batch fails clearly
            if work.plan is not self.plan:
                return  # re-planned while the step waited or ran: activate() told the origins, which replay
            if not isinstance(exc, ExoLikeError):
                log.exception("node %s: step of %d items failed", self.node_id, len(work.items))
            message = exc.message if isinstance(exc, ExoLikeError) else \
                f"stage on node {self.node_id} failed: {type(exc).__name__}: {exc}"
            code = exc.code if isinstance(exc, ExoLikeError) and exc.code else "stage_failed"
            for item in work.items:
                self._fail(item.rid, item.origin, message, code)
            return
        if work.plan is not self.plan:
            return  # re-planned while the step ran: activate() told the origins
        # Each item that ends where a token is sampled carries a generated token through this stage (a draft's
        # verification, as many as the last stage keeps: counted there, as it delivers them).
        if not is_last:
            self.throughput.add(sum(1 for item in work.items if item.sample is not None))
        else:
            self.throughput.add(len(result))
        if not is_last:
            assert isinstance(result, Activations)
            await self._send(work.plan.stages[index + 1].node_id,
                             Forward(work.plan.digest, tuple(work.items), result, self.kv_used), work.items)
            return
        await self._deliver(work.plan, result)

    def _compute(self, work: _Work, is_last: bool) -> Activations | list[tuple[WorkItem, SampledToken]]:
        """Engine thread: the step, and on the last stage sampling (per request, in item order)."""
        if work.plan is not self.plan or self.engine is None:
            # Re-planned while this step waited for the engine thread (behind a load, say): the engine may hold
            # other layers now, and the step's requests replay on the new ring.
            raise StepAbandoned()
        started = self._step_started = time.monotonic()
        try:
            out = self.engine.step(work.items, work.inputs)
            result = self._sample(work.items, out) if is_last else out
        finally:
            self._step_started = None
        self._last_step = time.monotonic()
        seconds = self._last_step - started
        if all(item.count == 1 for item in work.items):
            self.decode_step_seconds.add(seconds)
        if self.on_step is not None:
            self.on_step(seconds, sum(item.count for item in work.items))
        return result

    def _sample(self, items: Sequence[WorkItem], logits: np.ndarray) -> list[tuple[WorkItem, SampledToken]]:
        sampled: list[tuple[WorkItem, SampledToken]] = []
        row = 0
        for item in (item for item in items if item.sample is not None):
            rows = logits[row:row + item.sample.sampled_rows]
            row += item.sample.sampled_rows
            if item.sample.draft:
                sampled += self._verify(item, rows)
            else:
                sampled.append((item, self._sample_one(item, rows[0])))
        return sampled

    def _sample_one(self, item: WorkItem, row: np.ndarray) -> SampledToken:
        spec = item.sample
        index = item.end - spec.prompt_len  # generated tokens before this one
        state = self._state(item.rid, spec)
        constraint = state.constraint if state else None
        choice = choose(row, spec.params, spec.params.seed or 0, index, state.history if state else None,
                        constraint.allowed() if constraint else None)
        if constraint is not None:
            constraint.advance(choice.token)
        if state is not None and state.history is not None:
            state.history.add(choice.token)
        done = (choice.token in spec.eos or index + 1 >= spec.max_tokens
                or (constraint is not None and constraint.finished and not spec.eos))
        if done:
            self.sampler_states.pop(item.rid, None)
        return SampledToken(item.rid, choice.token, done, choice.logprob, choice.top_logprobs,
                            spec.cached if index == 0 else 0)

    def _verify(self, item: WorkItem, rows: np.ndarray) -> list[tuple[WorkItem, SampledToken]]:
        """A draft's tokens as far as the target keeps them, and the target's next (serving/speculative.py); the
        request ends at its first end-of-sequence token or its last allowed one."""
        spec = item.sample
        first = item.end - len(spec.draft) - spec.prompt_len  # the first sampled row's generated index
        kept = verify(rows, spec.draft, spec.params, spec.params.seed or 0, first)
        tokens = []
        for offset, token in enumerate(kept):
            index = first + offset
            done = token in spec.eos or index + 1 >= spec.max_tokens
            tokens.append((item, SampledToken(item.rid, token, done, None, (), spec.cached if index == 0 else 0)))
            if done:
                break
        return tokens

    def _state(self, rid: str, spec: SampleSpec) -> SamplerState | None:
        """What a stateful request's sampling reads here: its token history (penalties) and its grammar's matcher.
        Its first token brings its tokens (and grammar); None for a request without state."""
        if spec.history is not None:
            self.sampler_states[rid] = self._new_state(spec)
        state = self.sampler_states.get(rid)
        if state is None and spec.params.penalized:  # released while this step ran: its token goes nowhere
            log.info("node %s: request %s has no token history here (released?); sampled without penalties",
                     self.node_id, rid)
        return state

    def _new_state(self, spec: SampleSpec) -> SamplerState:
        assert spec.history is not None
        prompt, generated = spec.history[:spec.prompt_len], spec.history[spec.prompt_len:]
        constraint = None
        if spec.params.grammar is not None:
            vocabulary = self.grammar_vocabulary()
            if vocabulary is None:
                raise RuntimeError("a constrained request reached a node that serves no model")
            constraint = vocabulary.constraint(spec.params.grammar, generated)
        history = TokenHistory(prompt, generated) if spec.params.penalized else None
        return SamplerState(history, constraint)

    async def _deliver(self, plan: Plan, sampled: list[tuple[WorkItem, SampledToken]]) -> None:
        """The tokens go to the first stage first (the next step is on the critical path), then to each origin."""
        if not sampled:
            return
        tokens = tuple(token for _, token in sampled)
        items = [item for item, _ in sampled]
        await self._send(plan.stages[0].node_id, Sampled(plan.digest, tokens), items)
        by_origin: dict[str, list[SampledToken]] = {}
        for item, token in sampled:
            by_origin.setdefault(item.origin, []).append(token)
        for origin, own in by_origin.items():
            try:
                await self.router.send(origin, Tokens(plan.digest, tuple(own)))
            except (ConnectionError, OSError):
                for token in own:  # the origin is gone: nobody will stream these, stop computing them
                    await self._release(plan, token.rid)

    async def _send(self, node_id: str, message: Message, items: Sequence[WorkItem]) -> None:
        try:
            await self.router.send(node_id, message)
        except (ConnectionError, OSError) as exc:
            for item in items:
                self._fail(item.rid, item.origin, f"node {node_id} is unreachable: {exc}", "node_unreachable")

    def _fail(self, rid: str, origin: str, message: str, code: str) -> None:
        """Tell the origin the request failed, and free it at the first stage."""
        self._notify(rid, origin, message, code)
        if self.plan is not None:
            self._spawn(self._release(self.plan, rid))

    async def _release(self, plan: Plan, rid: str) -> None:
        self.sampler_states.pop(rid, None)
        try:
            await self.router.send(plan.stages[0].node_id, Release(rid))
        except (ConnectionError, OSError):
            pass  # the first stage is gone, and the request's blocks with it

    def _notify(self, rid: str, origin: str, message: str, code: str) -> None:
        self._spawn(self._send_error(origin, Error(rid, message, code)))

    async def _send_error(self, origin: str, error: Error) -> None:
        try:
            await self.router.send(origin, error)
        except (ConnectionError, OSError):
            pass  # the origin is gone too: nobody is waiting

    def _spawn(self, coro: object) -> None:
        task = asyncio.ensure_future(coro)  # type: ignore[arg-type]
        self._notices.add(task)
        task.add_done_callback(self._notices.discard)

    # -- reporting ------------------------------------------------------------------------------------------

    def step_seconds(self) -> float:
        """How long the engine has been inside the step it is running now (0 when it is not running one)."""
        started = self._step_started
        return 0.0 if started is None else time.monotonic() - started

    def active_requests(self) -> int:
        """Requests the ring holds KV for, as the first stage counts them (0 on other stages)."""
        if self.scheduler is None:
            return len(self._submitted)
        return len(self.scheduler.running) + len(self.scheduler.waiting)

    def scheduler_counts(self) -> dict[str, int]:
        """KV blocks in use, requests batched and waiting; since start: prefix-cache lookups and hits (tokens),
        preemptions, draft tokens proposed and kept, and the verification steps (drafts)."""
        totals = [total + now for total, now in zip(self._totals, self._scheduler_totals())]
        counts = dict(zip(("prefix_queries", "prefix_hits", "preemptions", "draft_tokens", "accepted_tokens",
                           "drafts"), totals))
        scheduler = self.scheduler
        if scheduler is None:
            return {"kv_used": self.kv_used, "running": 0, "waiting": len(self._submitted), **counts}
        return {"kv_used": scheduler.pool.used, "running": len(scheduler.running),
                "waiting": len(scheduler.waiting), **counts}

    def _scheduler_totals(self) -> tuple[int, ...]:
        scheduler = self.scheduler
        if scheduler is None:
            return (0, 0, 0, 0, 0, 0)
        return (scheduler.prefix_queries, scheduler.prefix_hits, scheduler.preemptions, scheduler.draft_tokens,
                scheduler.accepted_tokens, scheduler.drafts)

    def busy(self) -> bool:
        """Whether this stage's layers are serving requests right now (or did within the last second)."""
        return self.active_requests() > 0 or bool(self._inbox) or time.monotonic() - self._last_step < 1.0


def attention_scale(engine: Engine | None) -> int | None:
    """Positions of context at which one prompt token's attention costs about as much as its share of the
    layers' products, on this engine: about twice the hidden size for Llama-shaped layers on a CPU (measured with
    the interleaving section of bench/bench_concurrency.py)."""
    if engine is None or engine.args is None:
        return None
    return 2 * engine.args.hidden_size


def _written_slots(items: Sequence[WorkItem]) -> list[tuple[int, int]]:
    """(block, offset) of every position the items write."""
    return [(item.blocks[p // BLOCK_SIZE], p % BLOCK_SIZE) for item in items for p in range(item.start, item.end)]
