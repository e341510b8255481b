"""The first stage's scheduler: which requests' tokens the ring computes in each step.

Continuous batching as vLLM does it: every step takes each running request that has a token to compute (decode
first), then chunks of prompts up to a token budget, so a long prompt no longer stalls everyone else's stream.
New requests are admitted while the KV pool has room for their whole prompt (waiting in arrival order otherwise);
a running request that needs a block when the pool is full takes it from the most recently admitted request,
which is put back to wait and recomputed later (its tokens so far are kept, and sampling is a function of the
seed and the token's index, so its text does not change).

Pure bookkeeping, no engine and no network: the stage worker (stage.py) turns a Step into an engine call. Which
blocks of the KV pools a request holds is the KV cache manager's (kv_cache.py); the scheduler orders, budgets and
preempts.
"""

from __future__ import annotations

import itertools
import math
from collections import deque
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field, replace

import numpy as np

from exo_like.cluster.protocol import MAX_DRAFT
from exo_like.engines.work import BLOCK_SIZE, SampleSpec, WorkItem
from exo_like.serving.kv_blocks import BlockPool
from exo_like.serving.kv_cache import KVCache, RequestBlocks
from exo_like.serving.speculative import propose_ngram, speculable

# Rows of one engine step, by where the first stage computes, unless --max-batch-tokens says otherwise: big steps
# prefill fastest (each step reads every weight once) when nobody waits for tokens...
DEFAULT_MAX_BATCH_TOKENS = {"cpu": 512, "accelerator": 2048}
# ...while requests are streaming, prompt chunks are kept small so their steps stay close to a step of the
# streams' tokens alone (on 2 CPU cores a 32-token chunk adds ~40 ms to a ~50 ms step), and weigh more the deeper
# they are in a long prompt (see attention_scale).
DEFAULT_INTERLEAVE_TOKENS = {"cpu": 32, "accelerator": 512}
DEFAULT_MAX_RUNNING = 64
DRAFT_MIN_RATE = 0.2  # a request whose proposals are kept less often than this gets none


@dataclass(frozen=True)
class SchedulerLimits:
    max_batch_tokens: int | None = None  # rows of one step (vLLM's max_num_batched_tokens); None: by device
    max_running: int = DEFAULT_MAX_RUNNING  # requests holding KV blocks at once (vLLM's max_num_seqs)
    prefix_cache: bool = True
    interleave_tokens: int | None = None  # rows of one step while requests stream; None: by device
    # Speculative decoding by prompt lookup (serving/speculative.py): up to this many proposed tokens a decode
    # step of a request (0: none), while no more than speculative_max_running requests run (under load a step
    # is full anyway, and verifying rejected drafts would only cost).
    speculative_tokens: int = 0
    speculative_max_running: int = 4

    def __post_init__(self) -> None:
        budgets = (self.max_batch_tokens, self.interleave_tokens)
        if any(b is not None and b < 1 for b in budgets) or self.max_running < 1:
            raise ValueError("the batch token budgets and the running-request limit must be at least 1")
        if not 0 <= self.speculative_tokens <= MAX_DRAFT:
            raise ValueError(f"speculative tokens must be from 0 to {MAX_DRAFT}")

    def for_device(self, cpu: bool) -> "SchedulerLimits":
        """These limits with the batch token budgets decided (the defaults for a CPU or an accelerator)."""
        kind = "cpu" if cpu else "accelerator"
        batch = self.max_batch_tokens or DEFAULT_MAX_BATCH_TOKENS[kind]
        interleave = min(batch, self.interleave_tokens or DEFAULT_INTERLEAVE_TOKENS[kind])
        return replace(self, max_batch_tokens=batch, interleave_tokens=interleave)


@dataclass(eq=False)
class ScheduledRequest:
    """A request as the first stage tracks it: every token known so far and how many have KV in the ring."""

    rid: str
    origin: str
    tokens: list[int]
    sample: SampleSpec
    arrival: int
    computed: int = 0  # positions scheduled so far: their keys and values are (or will be) in `kv`'s blocks
    kv: RequestBlocks = field(default_factory=RequestBlocks)  # its blocks (the KV cache manager's)
    history_sent: bool = False  # the last stage has its sampling state (sent once, see _sample_spec)
    admitted: bool = False  # admitted once already (a preempted request's own blocks are no cache hit)
    in_flight: bool = False  # a token is being sampled for it: it has nothing to compute until that arrives
    batch: int = -1  # the step whose token it awaits, while in flight
    draft: tuple[int, ...] = ()  # tokens proposed for the step being scheduled (speculative decoding)
    verifying: int = 0  # tokens proposed in the step in flight
    # Its proposals so far, as a geometric rate: tokens kept, and tries (a kept token, or a rejection that ended
    # a run); a prior of 1 in 2: a new request starts with short drafts, longer as they are kept (_draft_length).
    kept: int = 1
    tries: int = 2

    @property
    def pending(self) -> int:
        """Known tokens whose keys and values are not scheduled yet."""
        return len(self.tokens) - self.computed


@dataclass(frozen=True)
class Failure:
    rid: str
    origin: str
    message: str
    code: str


@dataclass
class Step:
    items: list[WorkItem]
    tokens: np.ndarray  # the items' input token ids, in item order


class Scheduler:
    def __init__(self, n_blocks: int, limits: SchedulerLimits = SchedulerLimits(), pipeline_depth: int = 1,
                 cpu: bool = True, attention_scale: int | None = None, window: int | None = None,
                 n_window_blocks: int | None = None):
        self.kv = KVCache(n_blocks, window, n_window_blocks)
        self.limits = limits.for_device(cpu)
        # A prompt token at position p costs (1 + p // attention_scale) of the step's budget: its attention to the
        # p positions before it grows with p, so chunks late in a long prompt are smaller and the step's time
        # (and every stream's inter-token latency) stays about the same. None: every token costs 1.
        self.attention_scale = attention_scale
        self._weighted = False  # whether this step weighs prompt tokens by depth (only while requests stream)
        # Batches the ring should keep in flight: with stages on separate machines, splitting the decoding
        # requests into this many batches lets every stage work at once instead of waiting for one batch.
        self.pipeline_depth = max(1, pipeline_depth)
        self.waiting: deque[ScheduledRequest] = deque()
        self.running: dict[str, ScheduledRequest] = {}
        self.failures: list[Failure] = []  # requests ended by the scheduler, for the worker to report
        self.preemptions = 0
        # Prompt tokens looked up in the prefix cache at admission, and found there (vLLM counts tokens too). A
        # request that has to wait for blocks gives its cached ones back and is counted when it is admitted.
        self.prefix_queries = 0
        self.prefix_hits = 0
        self.draft_tokens = 0  # tokens proposed for verification, those kept, and the steps that verified them
        self.accepted_tokens = 0
        self.drafts = 0
        self._steps = 0
        self._arrivals = itertools.count()

    @property
    def pool(self) -> BlockPool:
        """The KV pool of the layers that attend to every position."""
        return self.kv.pool

    @property
    def window_pool(self) -> BlockPool | None:
        """The sliding-window layers' KV pool (None: the model has no such layers)."""
        return self.kv.window_pool

    # -- requests in and out ----------------------------------------------------------------------------

    def submit(self, rid: str, origin: str, tokens: Iterable[int], sample: SampleSpec) -> None:
        """A new request (or one replayed with the tokens it has so far): it waits for admission."""
        tokens = list(tokens)
        capacity = self.kv.capacity
        needed = len(tokens) + 1
        if needed > capacity:
            self.failures.append(Failure(rid, origin, (
                f"the request needs {needed} positions of KV cache but the ring's KV cache holds {capacity} "
                "(set a larger --kv-cache-gb on the nodes, or send a shorter prompt)"), "context_length_exceeded"))
            return
        if rid in self.running or any(seq.rid == rid for seq in self.waiting):
            self.failures.append(Failure(rid, origin, f"request id {rid!r} is already running", "duplicate_request"))
            return
        self.waiting.append(ScheduledRequest(rid, origin, tokens, sample, next(self._arrivals)))

    def on_sampled(self, rid: str, tokens: Sequence[int], done: bool) -> None:
        """A request's sampled tokens: one, or a verified draft's kept tokens and the target's next. Positions
        the step computed past the kept ones (a draft's rejected tokens) are given back: only the kept tokens'
        keys and values count, and the next step writes the rest again."""
        seq = self.running.get(rid)
        if seq is None:
            return  # released meanwhile
        seq.in_flight = False
        if seq.verifying:
            kept = min(len(tokens) - 1, seq.verifying)
            self.accepted_tokens += kept
            seq.kept, seq.tries = seq.kept + kept, seq.tries + kept + (kept < seq.verifying)
            seq.verifying = 0
        if done:
            self._finish(seq)
            return
        seq.tokens.extend(tokens)
        if seq.computed >= len(seq.tokens):  # a draft was rejected: its positions' keys and values are dropped
            seq.computed = len(seq.tokens) - 1
            self.kv.rollback(seq.kv, seq.computed)

    def release(self, rid: str) -> bool:
        """Drop a request wherever it is; False if it is not here."""
        seq = self.running.get(rid)
        if seq is not None:
            self._finish(seq)
            return True
        for seq in self.waiting:
            if seq.rid == rid:
                self.waiting.remove(seq)
                return True
        return False

    def drain(self) -> list[ScheduledRequest]:
        """Every request, removed (the plan changed: the ring they ran on is gone)."""
        requests = list(self.running.values()) + list(self.waiting)
        for seq in list(self.running.values()):
            self._finish(seq)
        self.waiting.clear()
        self.kv.clear()
        return requests

    def _finish(self, seq: ScheduledRequest) -> None:
        del self.running[seq.rid]
        self.kv.free(seq.kv)

    # -- steps --------------------------------------------------------------------------------------------

    def batches_in_flight(self) -> int:
        return len({s.batch for s in self.running.values() if s.in_flight})

    def schedule(self) -> Step | None:
        """The next step's items (decode tokens first, then prompt chunks), or None if nothing can run now.

        No more than `pipeline_depth` batches are out at once: with stages sharing one machine, requests whose
        tokens come back a little apart would otherwise go round as separate batches for ever, each reading
        every stage's weights again; waiting for the batch in flight keeps them in one."""
        if self.batches_in_flight() >= self.pipeline_depth:
            return None
        # While requests stream, prompts get small chunks on top of the streams' tokens; else big ones. A request
        # recomputing its generated tokens (preempted, or replayed on a new ring) is not streaming yet.
        streaming = any(s.pending <= 1 and len(s.tokens) > s.sample.prompt_len for s in self.running.values())
        self._weighted = streaming
        rows_left = self.limits.max_batch_tokens
        prompt_budget = self.limits.interleave_tokens if streaming else rows_left
        chosen: list[tuple[ScheduledRequest, int]] = []
        decode_quota = math.ceil(len(self.running) / self.pipeline_depth)
        ready = [s for s in self.running.values() if not s.in_flight and s.pending > 0]
        ready.sort(key=lambda s: (s.pending > 1, s.arrival))
        for seq in ready:
            if rows_left == 0:
                break
            if seq.rid not in self.running:
                continue  # preempted for an earlier one in this loop
            if seq.pending == 1:
                if decode_quota == 0:
                    continue
                decode_quota -= 1
                seq.draft = self._propose(seq, rows_left)
                count = self._grow(seq, 1 + len(seq.draft), chosen)
                seq.draft = seq.draft[:max(0, count - 1)]
            else:
                want = self._chunk(seq, min(prompt_budget, rows_left), chosen)
                count = self._grow(seq, want, chosen) if want else 0
                prompt_budget -= min(prompt_budget, count * self._weight(seq.computed))
            if count:
                chosen.append((seq, count))
                rows_left -= count
        while rows_left and self.waiting and len(self.running) < self.limits.max_running:
            count = self._admit(self.waiting[0], min(prompt_budget, rows_left), chosen)
            if not count:
                break
            seq = self.waiting.popleft()
            chosen.append((seq, count))
            rows_left -= count
            prompt_budget -= min(prompt_budget, count * self._weight(seq.computed))
        if not chosen:
            return None
        self._steps += 1
        return self._step(chosen)

    def _propose(self, seq: ScheduledRequest, rows_left: int) -> tuple[int, ...]:
        """Tokens to verify beside a decoding request's next one: a prompt lookup's, where speculation is on and
        pays (few requests running), within the rows left and the tokens the request may still make."""
        limits = self.limits
        if not limits.speculative_tokens or len(self.running) > limits.speculative_max_running or \
                not speculable(seq.sample.params):
            return ()
        left = seq.sample.max_tokens - (len(seq.tokens) - seq.sample.prompt_len) - 1
        rate = seq.kept / seq.tries
        if rate < DRAFT_MIN_RATE:
            return ()  # its text has not repeated itself: a draft would cost rows and keep nothing
        # While few proposals are kept, only long matches (a repeated phrase, not a repeated word) propose.
        shortest = 1 if rate >= 0.5 else 3
        return propose_ngram(seq.tokens, min(self._draft_length(rate), left, rows_left - 1), min_n=shortest)

    def _draft_length(self, rate: float) -> int:
        """Tokens worth proposing at a kept rate a: a draft's kept run averages a / (1 - a) tokens; one more than
        that (a rejected token costs a row of the step, a kept one saves a trip round the ring), within the
        limit."""
        run = rate / (1 - rate) if rate < 1 else float(self.limits.speculative_tokens)
        return max(1, min(self.limits.speculative_tokens, round(run) + 1))

    def _weight(self, position: int) -> int:
        if self.attention_scale is None or not self._weighted:
            return 1
        return 1 + position // self.attention_scale

    def _chunk(self, seq: ScheduledRequest, budget: int, chosen: list[tuple[ScheduledRequest, int]]) -> int:
        """How many of a request's pending tokens fit the budget left; at least one for the first prompt of the
        step, so a prompt too deep for any chunk still moves."""
        if seq.pending == 1:
            return 1
        count = min(seq.pending, budget // self._weight(seq.computed))
        return count if count or any(s.pending > 1 for s, _ in chosen) else 1

    def _admit(self, seq: ScheduledRequest, budget: int, chosen: list[tuple[ScheduledRequest, int]]) -> int:
        """Give the oldest waiting request the blocks for its first chunk (after any cached prefix)."""
        if self.limits.prefix_cache:
            seq.computed = self.kv.take_prefix(seq.kv, seq.tokens)
        count = self._chunk(seq, budget, chosen)
        # Blocks for the whole prompt at once, in one run after any cached prefix where the pool allows: its
        # later chunks then attend to consecutive slots (see BlockPool), and it is admitted only when all fit.
        # (Sliding-window layers' blocks come chunk by chunk: their window holds few.)
        if not count or not self.kv.allocate(seq.kv, len(seq.tokens), seq.computed + count):
            self.kv.free(seq.kv)  # wait without holding cached blocks others may need
            seq.computed = 0
            return 0
        self.running[seq.rid] = seq
        if self.limits.prefix_cache:
            cached = seq.kv.registered * BLOCK_SIZE
            self.prefix_queries += len(seq.tokens)
            self.prefix_hits += cached
            if not seq.admitted and cached:  # the request's usage reports them (its first token brings it)
                seq.sample = replace(seq.sample, cached=cached)
        seq.admitted = True
        return count

    def _grow(self, seq: ScheduledRequest, count: int, chosen: list[tuple[ScheduledRequest, int]]) -> int:
        """Blocks for `count` more positions of a running request, preempting newer idle requests if a pool
        is full; the positions it can have (0: it waits)."""
        self.kv.slide(seq.kv, seq.computed)
        end = seq.computed + count
        busy = {s.rid for s, _ in chosen} | {seq.rid}
        while not self.kv.allocate(seq.kv, end, end):
            victims = [s for s in self.running.values() if not s.in_flight and s.rid not in busy]
            if not victims:
                room = self.kv.held_positions(seq.kv) - seq.computed  # what its own last blocks still hold
                if room == 0 and len(self.running) == 1:
                    self._fail_alone(seq)
                return min(room, count)
            self._preempt(max(victims, key=lambda s: s.arrival))
        return count

    def _preempt(self, seq: ScheduledRequest) -> None:
        """Free a running request's blocks and put it back first in line; it will be recomputed from its tokens."""
        self._finish(seq)
        seq.computed = 0
        seq.history_sent = False
        self.waiting.appendleft(seq)
        self.preemptions += 1

    def _fail_alone(self, seq: ScheduledRequest) -> None:
        self._finish(seq)
        self.failures.append(Failure(seq.rid, seq.origin, (
            f"the ring's KV cache ({self.kv.capacity} positions) is full with this request alone "
            "(set a larger --kv-cache-gb on the nodes, or ask for fewer tokens)"), "kv_cache_full"))

    def _step(self, chosen: list[tuple[ScheduledRequest, int]]) -> Step:
        items, tokens = [], []
        for seq, count in chosen:
            start = seq.computed
            seq.computed += count
            draft, seq.draft = (seq.draft if seq.pending < 0 else ()), ()  # (positions past the known tokens)
            sample = seq.computed >= len(seq.tokens)
            seq.in_flight, seq.batch = sample, self._steps
            blocks, window_blocks, window_first = self.kv.table(seq.kv)
            spec = self._sample_spec(seq) if sample else None
            if draft:
                spec = replace(spec, draft=draft)
                seq.verifying = len(draft)
                self.draft_tokens += len(draft)
                self.drafts += 1
            items.append(WorkItem(seq.rid, seq.origin, start, count, blocks, spec, window_blocks, window_first))
            tokens.extend([*seq.tokens[start:seq.computed], *draft])
            if self.limits.prefix_cache:  # (a draft's positions once their tokens are kept: on_sampled)
                self.kv.register_full_blocks(seq.kv, seq.tokens, min(seq.computed, len(seq.tokens)))
        return Step(items, np.asarray(tokens, dtype=np.int64))

    @staticmethod
    def _sample_spec(seq: ScheduledRequest) -> SampleSpec:
        """How the request's next token is sampled. A request with state at the last stage (penalties, a grammar)
        sends its whole token history and its grammar the first time (and after a preemption); the last stage then
        advances that state with each token it samples, and later specs leave the grammar out."""
        params = seq.sample.params
        if not params.needs_history:
            return seq.sample
        if seq.history_sent:
            return seq.sample if params.grammar is None else replace(seq.sample, params=replace(params, grammar=None))
        seq.history_sent = True
        return replace(seq.sample, history=tuple(seq.tokens))
