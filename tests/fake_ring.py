"""An in-process ring for tests: stage workers and origins linked by a fake router that encodes every message as
the peer protocol does, and a fake engine whose output depends on every position's KV.

The fake engine's "model": each stage stores its input per slot and outputs, for each row, a mix of everything
stored at the row's positions [0, end). A request's tokens are therefore a function of its whole token history,
and any mix-up of KV blocks (sharing, reuse after release, preemption, a replay that skips a token) changes them.
With a `window`, it also stores its input in a sliding-window pool of its own (the window tables the first stage
hands out) and mixes in what that pool holds at the row's last `window` positions.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor

import numpy as np

from exo_like.cluster.protocol import Error, Message, Tokens, decode, encode
from exo_like.engines.activations import Activations
from exo_like.engines.base import Engine
from exo_like.engines.batch import ItemLayout, layout
from exo_like.engines.work import KVPoolSize, WorkItem, window_start
from exo_like.errors import ServiceUnavailableError
from exo_like.serving.grammar import GrammarVocabulary
from exo_like.serving.ring_generator import RingGenerator
from exo_like.serving.sampling import SamplingParams
from exo_like.serving.scheduler import SchedulerLimits
from exo_like.serving.stage import RingResources, StageWorker
from partitioning import Stage
from partitioning.plan import Plan

VOCAB = 97
MODULUS = 1_000_003


class FakeEngine(Engine):
    name = "fake"

    def __init__(self, stage_index: int, last: bool, n_blocks: int, delay: float = 0.0, window: int | None = None,
                 n_window_blocks: int = 0, window_from_full: bool = False, vocab: int = VOCAB, copying: int = 0):
        """copying (a one-stage ring): each token repeats the one `copying` positions back, except at every
        fifth position: a model whose answers prompt lookup predicts, mostly."""
        super().__init__()
        self.copying = copying
        self.stage_index, self.last, self.delay, self.vocab = stage_index, last, delay, vocab
        self.store = np.zeros(n_blocks * 16, dtype=np.int64)
        self.n_blocks = n_blocks
        self.window, self.n_window_blocks = window, n_window_blocks
        self.window_store = np.zeros(n_window_blocks * 16, dtype=np.int64)
        self.window_from_full = window_from_full  # the reference: read the window from the full pool
        self.window_tables: list[tuple[int, ...]] = []  # every window table seen for a decode row
        self.calls: list[list[tuple[str, int, int]]] = []
        self.items: list[WorkItem] = []  # every item run, in order
        self.fail_on: str | None = None  # a rid whose presence in a batch makes the step fail

    def step(self, items: Sequence[WorkItem], inputs: np.ndarray | Activations) -> Activations | np.ndarray:
        self.calls.append([(i.rid, i.start, i.count) for i in items])
        self.items.extend(items)
        self.window_tables += [i.window_blocks for i in items if i.count == 1 and i.window_blocks is not None]
        if self.fail_on is not None and any(i.rid == self.fail_on for i in items):
            raise RuntimeError("the fake engine broke")
        time.sleep(self.delay)
        batch = layout(items, self.n_blocks, 1 << 20)
        values = (np.asarray(inputs) if isinstance(inputs, np.ndarray) else
                  inputs.bits()[:, 0].astype(np.int64)) + 1000 * (self.stage_index + 1)
        self.store[batch.write_slots] = values
        windowed = None if self.window is None else layout(items, self.n_window_blocks, 1 << 20, self.window)
        if windowed is not None:
            self.window_store[windowed.write_slots] = values
        out = np.empty(batch.rows, dtype=np.int64)
        for i, item in enumerate(batch.items):
            for row in range(item.row_start, item.row_end):
                visible = item.slots[: item.start + (row - item.row_start) + 1]
                mix = int((self.store[visible] * np.arange(1, len(visible) + 1)).sum())
                if windowed is not None:
                    source = (item, self.store) if self.window_from_full else (windowed.items[i], self.window_store)
                    mix += 7 * self._window_mix(*source, item.start + row - item.row_start)
                out[row] = mix % MODULUS
                position = item.start + row - item.row_start
                if self.copying and len(visible) > self.copying and position % 5:
                    out[row] = self.store[visible[-self.copying]] - 1000 * (self.stage_index + 1)
        if not self.last:
            hidden = np.stack([out, np.zeros_like(out)], axis=1).astype(np.float32)
            return Activations("float32", hidden.shape, hidden.tobytes())
        logits = np.zeros((len(batch.sample_rows), self.vocab), dtype=np.float32)
        logits[np.arange(len(batch.sample_rows)), out[batch.sample_rows] % self.vocab] = 1.0
        return logits

    def _window_mix(self, item: ItemLayout, store: np.ndarray, position: int) -> int:
        first = window_start(position, self.window)
        seen = item.slots[first - item.origin: position + 1 - item.origin]
        return int((store[seen] * np.arange(first + 1, position + 2)).sum())

    def load(self, *args, **kwargs) -> None:  # noqa: ANN002, ANN003
        raise NotImplementedError

    def layer_form(self, *args, **kwargs) -> str:  # noqa: ANN002, ANN003
        raise NotImplementedError

    def layer_runner(self, *args, **kwargs) -> None:  # noqa: ANN002, ANN003
        raise NotImplementedError

    def kv_block_bytes(self) -> tuple[int, int]:
        return 1, int(self.window is not None)

    def allocate_kv(self, n_blocks: int, n_window_blocks: int | None = None) -> None:
        raise NotImplementedError

    @property
    def kv_size(self) -> KVPoolSize:
        return KVPoolSize(self.n_blocks, self.n_window_blocks if self.window is not None else None)

    @property
    def kv_window(self) -> int | None:
        return self.window

    def parameter_bytes(self) -> int:
        return 0

    @property
    def device_name(self) -> str:
        return "fake"

    @property
    def on_cpu(self) -> bool:
        return True

    @property
    def dtype_name(self) -> str:
        return "float32"


class FakeNode:
    """A stage worker and an origin, delivering messages the way exo_like.node.Node does."""

    def __init__(self, node_id: str, net: "FakeNetwork", limits: SchedulerLimits, kv_blocks: int, depth: int,
                 delay: float, request_wait: float, window: int | None, window_blocks: int, window_from_full: bool,
                 vocab: int = VOCAB, grammar: GrammarVocabulary | None = None):
        self.node_id = node_id
        self.vocab = vocab
        self.net = net
        self.kv_blocks, self.delay = kv_blocks, delay
        self.window, self.window_blocks, self.window_from_full = window, window_blocks, window_from_full
        self.engine: FakeEngine | None = None
        self.executor = ThreadPoolExecutor(1)
        resources = RingResources(kv_blocks, depth, window_blocks if window is not None else None)
        self.stage = StageWorker(node_id, self, self.executor, lambda plan: resources, limits,
                                 grammar_vocabulary=lambda: grammar)
        self.origin = RingGenerator(node_id, self, net.wait_ready, self.stage, request_wait=request_wait)

    def serve(self, plan: Plan) -> None:
        """Hold this node's stage of `plan` (a fresh engine: its KV cache starts empty, as after a reload)."""
        index = plan.stage_index(self.node_id)
        self.engine = None if index is None else FakeEngine(
            index, index == len(plan.stages) - 1, self.kv_blocks, self.delay, self.window, self.window_blocks,
            self.window_from_full, self.vocab)
        self.stage.activate(plan, self.engine)

    async def send(self, node_id: str, message: Message) -> None:
        await self.net.send(node_id, message)

    def deliver(self, message: Message) -> None:
        if isinstance(message, (Tokens, Error)):
            self.origin.handle(message)
        else:
            self.stage.handle(message)


def make_plan(ids: Sequence[str], layers: int = 4) -> Plan:
    n = len(ids)
    stages = tuple(Stage(node_id, i * layers // n, (i + 1) * layers // n) for i, node_id in enumerate(ids))
    return Plan("fake-model", layers, stages, tuple((n, 1) for n in ids))


class FakeNetwork:
    """In-order delivery per (sender, receiver) pair, every message through protocol.encode/decode.

    `spares` nodes are linked but hold no stage until a re-plan gives them one. `lose` takes a node off the network
    (sends to it fail), `replan` makes every remaining node serve a new plan, as a cluster does after a loss or a
    join; origins wait for it like Cluster.wait_ready (up to their timeout)."""

    def __init__(self, n_stages: int, limits: SchedulerLimits = SchedulerLimits(256), kv_blocks: int = 256,
                 delays: Sequence[float] = (), depth: int = 1, spares: int = 0, request_wait: float = 5.0,
                 window: int | None = None, window_blocks: int = 0, window_from_full: bool = False,
                 vocab: int = VOCAB, grammar: GrammarVocabulary | None = None):
        ids = [f"n{i}" for i in range(n_stages + spares)]
        self.plan = make_plan(ids[:n_stages])
        self.nodes = {node_id: FakeNode(node_id, self, limits, kv_blocks, depth,
                                        delays[i] if i < len(delays) else 0.0, request_wait, window, window_blocks,
                                        window_from_full, vocab, grammar)
                      for i, node_id in enumerate(ids)}
        self.lost: dict[str, FakeNode] = {}
        self.problem: str | None = None  # why no plan can serve the model (as Cluster.problem)
        self.sent: list[Message] = []
        self.ready = asyncio.Event()

    def start(self) -> None:
        for node in self.nodes.values():
            node.serve(self.plan)
        self.ready.set()

    async def wait_ready(self, timeout: float | None = None) -> Plan:
        if self.problem is not None:
            raise ServiceUnavailableError(self.problem, code="plan_unavailable")
        try:
            await asyncio.wait_for(self.ready.wait(), timeout)
        except asyncio.TimeoutError:
            raise ServiceUnavailableError("no agreed plan: the fake cluster is re-planning",
                                          code="plan_unavailable") from None
        return self.plan

    def lose(self, node_id: str) -> None:
        """The node is gone: the others see their link to it close (the origins first, as Cluster does)."""
        self.lost[node_id] = self.nodes.pop(node_id)
        self.ready.clear()
        for node in self.nodes.values():
            node.origin.members_changed(set(self.nodes))

    def replan(self, ids: Sequence[str]) -> None:
        self.plan = make_plan(ids)
        for node in self.nodes.values():
            node.serve(self.plan)
        self.ready.set()

    async def send(self, node_id: str, message: Message) -> None:
        self.sent.append(message)
        if node_id not in self.nodes:
            raise ConnectionError(f"no link to {node_id}")
        self.nodes[node_id].deliver(decode(encode(message)))

    @property
    def first(self) -> FakeNode:
        return self.nodes[self.plan.stages[0].node_id]

    async def close(self) -> None:
        for node in [*self.nodes.values(), *self.lost.values()]:
            await node.stage.close()
            node.executor.shutdown()


async def generate(origin: FakeNode, rid: str, prompt: list[int], max_tokens: int = 12,
                   sampling: SamplingParams = SamplingParams(temperature=0.0)) -> list[int]:
    tokens = []
    async with contextlib.aclosing(origin.origin.generate(rid, prompt, sampling, max_tokens, ())) as stream:
        async for choice in stream:
            tokens.append(choice.token)
    return tokens


@contextlib.asynccontextmanager
async def ring(n_stages: int = 1, **kwargs):  # noqa: ANN003, ANN201
    net = FakeNetwork(n_stages, **kwargs)
    net.start()
    try:
        yield net
    finally:
        await net.close()


