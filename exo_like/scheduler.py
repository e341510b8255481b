"""The first stage's scheduler: which requests' tokens the ring computes in each step.

Continuous batching as vLLM does it: every step takes each running request that has a token to compute (decode
first), then chunks of prompts up to a token budget, so a long prompt no longer stalls everyone else's stream.
New requests are admitted while the KV pool has room for their prompt (waiting in arrival order otherwise);
a running request that needs a block when the pool is full takes it from the most recently admitted request,
which is put back to wait and recomputed later (its tokens so far are kept, and sampling is a function of the
seed and the token's index, so its text does not change).

Pure bookkeeping, no engine and no network: the stage worker (stage.py) turns a Step into an engine call.
"""

from __future__ import annotations

import itertools
import math
from collections import deque
from dataclasses import dataclass, field, replace

import numpy as np

from exo_like.kv_blocks import BLOCK_SIZE, ROOT_HASH, BlockPool, block_hash, blocks_for
from exo_like.protocol import SampleSpec, Submit, WorkItem

# Rows of one engine step unless --max-batch-tokens says otherwise, by where the first stage computes. On a CPU a
# step of 64 rows takes about twice a step of a few decode rows (2 cores, SmolLM2-135M float32), so prompts
# arriving in 64-token chunks keep running streams' inter-token latency within 3x its median while prefilling
# nearly as fast as in bigger chunks; an accelerator runs much bigger steps in the same time.
DEFAULT_MAX_BATCH_TOKENS = {"cpu": 64, "accelerator": 512}
DEFAULT_MAX_RUNNING = 64


@dataclass(frozen=True)
class SchedulerLimits:
    max_batch_tokens: int | None = None  # rows of one step (vLLM's max_num_batched_tokens); None: by device
    max_running: int = DEFAULT_MAX_RUNNING  # requests holding KV blocks at once (vLLM's max_num_seqs)
    prefix_cache: bool = True

    def __post_init__(self) -> None:
        if (self.max_batch_tokens is not None and self.max_batch_tokens < 1) or self.max_running < 1:
            raise ValueError("the batch token budget and the running-request limit must be at least 1")

    def for_device(self, cpu: bool) -> "SchedulerLimits":
        """These limits with the batch token budget decided (the default for a CPU or an accelerator)."""
        if self.max_batch_tokens is not None:
            return self
        return replace(self, max_batch_tokens=DEFAULT_MAX_BATCH_TOKENS["cpu" if cpu else "accelerator"])


@dataclass(eq=False)
class Sequence:
    """A request as the first stage tracks it: every token known so far and how many have KV in the ring."""

    rid: str
    origin: str
    tokens: list[int]
    sample: SampleSpec
    arrival: int
    computed: int = 0  # positions scheduled so far: their keys and values are (or will be) in `blocks`
    blocks: list[int] = field(default_factory=list)
    registered: int = 0  # leading blocks registered in the prefix cache
    parent_hash: bytes = ROOT_HASH  # hash of the last registered block
    in_flight: bool = False  # a token is being sampled for it: it has nothing to compute until that arrives
    batch: int = -1  # the step whose token it awaits, while in flight
    cached_prompt: int = 0  # prompt positions taken from the prefix cache at admission

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

    @property
    def rows(self) -> int:
        return int(self.tokens.shape[0])


class Scheduler:
    def __init__(self, n_blocks: int, limits: SchedulerLimits = SchedulerLimits(), pipeline_depth: int = 1,
                 cpu: bool = True):
        self.pool = BlockPool(n_blocks)
        self.limits = limits.for_device(cpu)
        # Batches the ring should keep in flight: with stages on separate machines, splitting the decoding
        # requests into this many batches lets every stage work at once instead of waiting for one batch.
        self.pipeline_depth = max(1, pipeline_depth)
        self.waiting: deque[Sequence] = deque()
        self.running: dict[str, Sequence] = {}
        self.failures: list[Failure] = []  # requests ended by the scheduler, for the worker to report
        self.preemptions = 0
        self._steps = 0
        self._arrivals = itertools.count()

    # -- requests in and out ----------------------------------------------------------------------------

    def submit(self, message: Submit) -> None:
        capacity = self.pool.n_blocks * BLOCK_SIZE
        needed = len(message.tokens) + 1
        if needed > capacity:
            self.failures.append(Failure(message.rid, message.origin, (
                f"the request needs {needed} positions of KV cache but the ring's KV cache holds {capacity} "
                "(set a larger --kv-cache-gb on the nodes, or send a shorter prompt)"), "context_length_exceeded"))
            return
        if message.rid in self.running or any(seq.rid == message.rid for seq in self.waiting):
            self.failures.append(Failure(message.rid, message.origin, f"request id {message.rid!r} is already "
                                         "running", "duplicate_request"))
            return
        self.waiting.append(Sequence(message.rid, message.origin, list(message.tokens), message.sample,
                                     next(self._arrivals)))

    def on_sampled(self, rid: str, token: int, done: bool) -> None:
        seq = self.running.get(rid)
        if seq is None:
            return  # released meanwhile
        seq.in_flight = False
        if done:
            self._finish(seq)
        else:
            seq.tokens.append(token)

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

    def drain(self) -> list[Sequence]:
        """Every request, removed (the plan changed: the ring they ran on is gone)."""
        sequences = list(self.running.values()) + list(self.waiting)
        for seq in list(self.running.values()):
            self._finish(seq)
        self.waiting.clear()
        self.pool.clear_cache()
        return sequences

    def _finish(self, seq: Sequence) -> None:
        del self.running[seq.rid]
        self.pool.release(seq.blocks)
        seq.blocks = []

    # -- steps --------------------------------------------------------------------------------------------

    def has_work(self) -> bool:
        return bool(self.waiting) or any(not s.in_flight and s.pending > 0 for s in self.running.values())

    def batches_in_flight(self) -> int:
        return len({s.batch for s in self.running.values() if s.in_flight})

    def schedule(self) -> Step | None:
        """The next step's items (decode tokens first, then prompt chunks), or None if nothing can run now.

        No more than `pipeline_depth` batches are out at once: with stages sharing one machine, requests whose
        tokens come back a little apart would otherwise go round as separate batches for ever, each reading
        every stage's weights again; waiting for the batch in flight keeps them in one."""
        if self.batches_in_flight() >= self.pipeline_depth:
            return None
        budget = self.limits.max_batch_tokens
        chosen: list[tuple[Sequence, int]] = []
        decode_quota = math.ceil(len(self.running) / self.pipeline_depth)
        ready = [s for s in self.running.values() if not s.in_flight and s.pending > 0]
        ready.sort(key=lambda s: (s.pending > 1, s.arrival))
        for seq in ready:
            if budget == 0:
                break
            if seq.rid not in self.running:
                continue  # preempted for an earlier one in this loop
            if seq.pending == 1:
                if decode_quota == 0:
                    continue
                decode_quota -= 1
            count = self._grow(seq, min(seq.pending, budget), chosen)
            if count:
                chosen.append((seq, count))
                budget -= count
        while budget and self.waiting and len(self.running) < self.limits.max_running:
            count = self._admit(self.waiting[0], budget)
            if not count:
                break
            chosen.append((self.waiting.popleft(), count))
            budget -= count
        if not chosen:
            return None
        self._steps += 1
        return self._step(chosen)

    def _admit(self, seq: Sequence, budget: int) -> int:
        """Give the oldest waiting request the blocks for its first chunk (after any cached prefix)."""
        if self.limits.prefix_cache:
            # At least one position is computed, so the last prompt token's logits exist to sample from.
            blocks, parent = self.pool.take_prefix(seq.tokens, (len(seq.tokens) - 1) // BLOCK_SIZE)
            seq.blocks, seq.parent_hash = blocks, parent
            seq.computed = seq.cached_prompt = len(blocks) * BLOCK_SIZE
            seq.registered = len(blocks)
        count = min(seq.pending, budget)
        new = self.pool.allocate(blocks_for(seq.computed + count) - len(seq.blocks))
        if new is None:
            self.pool.release(seq.blocks)  # wait without holding cached blocks others may need
            seq.blocks, seq.computed, seq.registered, seq.parent_hash = [], 0, 0, ROOT_HASH
            return 0
        seq.blocks += new
        self.running[seq.rid] = seq
        return count

    def _grow(self, seq: Sequence, count: int, chosen: list[tuple[Sequence, int]]) -> int:
        """Blocks for `count` more positions of a running request, preempting newer idle requests if the pool
        is full; the positions it can have (0: it waits)."""
        needed = blocks_for(seq.computed + count) - len(seq.blocks)
        if needed <= 0:
            return count
        busy = {s.rid for s, _ in chosen} | {seq.rid}
        while (new := self.pool.allocate(needed)) is None:
            victims = [s for s in self.running.values() if not s.in_flight and s.rid not in busy]
            if not victims:
                room = len(seq.blocks) * BLOCK_SIZE - seq.computed  # what its own last block still holds
                if room == 0 and len(self.running) == 1:
                    self._fail_alone(seq)
                return min(room, count)
            self._preempt(max(victims, key=lambda s: s.arrival))
        seq.blocks += new
        return count

    def _preempt(self, seq: Sequence) -> None:
        """Free a running request's blocks and put it back first in line; it will be recomputed from its tokens."""
        self._finish(seq)
        seq.computed, seq.registered, seq.parent_hash = 0, 0, ROOT_HASH
        self.waiting.appendleft(seq)
        self.preemptions += 1

    def _fail_alone(self, seq: Sequence) -> None:
        self._finish(seq)
        self.failures.append(Failure(seq.rid, seq.origin, (
            f"the ring's KV cache ({self.pool.n_blocks * BLOCK_SIZE} positions) is full with this request alone "
            "(set a larger --kv-cache-gb on the nodes, or ask for fewer tokens)"), "kv_cache_full"))

    def _step(self, chosen: list[tuple[Sequence, int]]) -> Step:
        items, tokens = [], []
        for seq, count in chosen:
            start = seq.computed
            seq.computed += count
            sample = seq.computed == len(seq.tokens)
            seq.in_flight, seq.batch = sample, self._steps
            items.append(WorkItem(seq.rid, seq.origin, start, count, tuple(seq.blocks),
                                  seq.sample if sample else None))
            tokens.extend(seq.tokens[start:seq.computed])
            if self.limits.prefix_cache:
                self._register_full_blocks(seq)
        return Step(items, np.asarray(tokens, dtype=np.int64))

    def _register_full_blocks(self, seq: Sequence) -> None:
        """Blocks whose every position is now scheduled can serve later prompts: later steps' readers of them
        reach each stage after this step's writers (every stage runs the first stage's steps in order)."""
        for i in range(seq.registered, seq.computed // BLOCK_SIZE):
            seq.parent_hash = block_hash(seq.parent_hash, seq.tokens[i * BLOCK_SIZE:(i + 1) * BLOCK_SIZE])
            self.pool.register(seq.blocks[i], seq.parent_hash)
            seq.registered = i + 1
