"""Stages and origins in one process, linked by a fake router that encodes every message as the peer protocol does:
continuous batching, ordering across a three-stage ring, cancellation mid-batch, prefix hits, a small KV budget,
batches merged on a busy stage, and a failing engine.

The fake engine's "model" depends on every position's KV: each stage stores its input per slot and outputs, for
each row, a mix of everything stored at the row's positions [0, end). A request's tokens are therefore a function
of its whole token history, and any mix-up of KV blocks (sharing, reuse after release, preemption) changes them.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest

from exo_like.activations import Activations
from exo_like.engines.base import Engine
from exo_like.engines.batch import layout
from exo_like.errors import ExoLikeError
from exo_like.protocol import (Error, Forward, Message, Release, SampleSpec, Sampled, Submit, Tokens, WorkItem,
                               decode, encode)
from exo_like.ring import RingGenerator
from exo_like.sampling import SamplingParams
from exo_like.scheduler import SchedulerLimits
from exo_like.stage import RingResources, StageWorker
from exo_like.plan import Plan
from partitioning import Stage

VOCAB = 97
MODULUS = 1_000_003


class FakeEngine(Engine):
    name = "fake"

    def __init__(self, stage_index: int, last: bool, n_blocks: int, delay: float = 0.0):
        super().__init__()
        self.stage_index, self.last, self.delay = stage_index, last, delay
        self.store = np.zeros(n_blocks * 16, dtype=np.int64)
        self.n_blocks = n_blocks
        self.calls: list[list[tuple[str, int, int]]] = []
        self.fail_on: str | None = None  # a rid whose presence in a batch makes the step fail

    def step(self, items: Sequence[WorkItem], inputs: np.ndarray | Activations) -> Activations | np.ndarray:
        self.calls.append([(i.rid, i.start, i.count) for i in items])
        if self.fail_on is not None and any(i.rid == self.fail_on for i in items):
            raise RuntimeError("the fake engine broke")
        time.sleep(self.delay)
        batch = layout(items, self.n_blocks, 1 << 20)
        values = (np.asarray(inputs) if isinstance(inputs, np.ndarray) else
                  inputs.bits()[:, 0].astype(np.int64)) + 1000 * (self.stage_index + 1)
        self.store[batch.write_slots] = values
        out = np.empty(batch.rows, dtype=np.int64)
        for item in batch.items:
            for row in range(item.row_start, item.row_end):
                visible = item.slots[: item.start + (row - item.row_start) + 1]
                out[row] = int((self.store[visible] * np.arange(1, len(visible) + 1)).sum() % MODULUS)
        if not self.last:
            hidden = np.stack([out, np.zeros_like(out)], axis=1).astype(np.float32)
            return Activations("float32", hidden.shape, hidden.tobytes())
        logits = np.zeros((len(batch.sample_rows), VOCAB), dtype=np.float32)
        logits[np.arange(len(batch.sample_rows)), out[batch.sample_rows] % VOCAB] = 1.0
        return logits

    def load(self, *args, **kwargs) -> None:  # noqa: ANN002, ANN003
        raise NotImplementedError

    def kv_block_bytes(self) -> int:
        return 1

    def allocate_kv(self, n_blocks: int) -> None:
        raise NotImplementedError

    @property
    def kv_blocks(self) -> int:
        return self.n_blocks

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

    def __init__(self, node_id: str, net: "FakeNetwork", engine: FakeEngine, limits: SchedulerLimits,
                 kv_blocks: int, depth: int):
        self.node_id = node_id
        self.net = net
        self.engine = engine
        self.executor = ThreadPoolExecutor(1)
        resources = RingResources(kv_blocks, depth)
        self.stage = StageWorker(node_id, self, self.executor, lambda plan: resources, limits)
        self.origin = RingGenerator(node_id, self, self._plan, self.stage)

    async def _plan(self) -> Plan:
        return self.net.plan

    async def send(self, node_id: str, message: Message) -> None:
        await self.net.send(node_id, message)

    def deliver(self, message: Message) -> None:
        if isinstance(message, (Tokens, Error)):
            self.origin.handle(message)
        else:
            self.stage.handle(message)


class FakeNetwork:
    """In-order delivery per (sender, receiver) pair, every message through protocol.encode/decode."""

    def __init__(self, n_stages: int, limits: SchedulerLimits = SchedulerLimits(256), kv_blocks: int = 256,
                 delays: Sequence[float] = (), depth: int = 1):
        ids = [f"n{i}" for i in range(n_stages)]
        layers = 4
        stages = tuple(Stage(node_id, i * layers // n_stages, (i + 1) * layers // n_stages)
                       for i, node_id in enumerate(ids))
        self.plan = Plan("fake-model", layers, stages, tuple((n, 1) for n in ids))
        self.nodes = {node_id: FakeNode(node_id, self, FakeEngine(i, i == n_stages - 1, kv_blocks,
                                                                  delays[i] if delays else 0.0),
                                        limits, kv_blocks, depth) for i, node_id in enumerate(ids)}
        self.sent: list[Message] = []

    def start(self) -> None:
        for node in self.nodes.values():
            node.stage.activate(self.plan, node.engine)

    async def send(self, node_id: str, message: Message) -> None:
        self.sent.append(message)
        self.nodes[node_id].deliver(decode(encode(message)))

    @property
    def first(self) -> FakeNode:
        return self.nodes[self.plan.stages[0].node_id]

    async def close(self) -> None:
        for node in self.nodes.values():
            await node.stage.close()
            node.executor.shutdown()


async def generate(origin: FakeNode, rid: str, prompt: list[int], max_tokens: int = 12,
                   sampling: SamplingParams = SamplingParams(temperature=0.0)) -> list[int]:
    tokens = []
    async with contextlib.aclosing(origin.origin.generate(rid, prompt, sampling, max_tokens, ())) as stream:
        async for token in stream:
            tokens.append(token)
    return tokens


@contextlib.asynccontextmanager
async def ring(n_stages: int = 1, **kwargs):  # noqa: ANN003, ANN201
    net = FakeNetwork(n_stages, **kwargs)
    net.start()
    try:
        yield net
    finally:
        await net.close()


PROMPTS = {f"r{i}": [(7 * i + j) % VOCAB for j in range(3 + 5 * i)] for i in range(8)}


async def alone_outputs(**kwargs) -> dict[str, list[int]]:  # noqa: ANN003
    results = {}
    for rid, prompt in PROMPTS.items():
        async with ring(**kwargs) as net:
            results[rid] = await generate(net.first, rid, prompt)
    return results


async def together(net: FakeNetwork, origins: Sequence[FakeNode] | None = None) -> dict[str, list[int]]:
    origins = origins or [net.first]
    tasks = {rid: generate(origins[i % len(origins)], rid, prompt) for i, (rid, prompt) in enumerate(PROMPTS.items())}
    return dict(zip(tasks, await asyncio.wait_for(asyncio.gather(*tasks.values()), 30)))


@pytest.fixture(scope="module")
def expected() -> dict[str, list[int]]:
    """Each request alone on a one-node ring."""
    return asyncio.run(alone_outputs())


@pytest.fixture(scope="module")
def expected3() -> dict[str, list[int]]:
    """Each request alone on a three-stage ring (the fake stages compute another function than one stage)."""
    return asyncio.run(alone_outputs(n_stages=3))


async def test_concurrent_requests_share_steps_and_equal_each_alone(expected) -> None:
    async with ring() as net:
        results = await together(net)
        calls = net.first.engine.calls
    assert results == expected
    assert len({tuple(v) for v in expected.values()}) == 8  # the fake model tells the requests apart
    assert max(len(call) for call in calls) == 8  # one step ran all eight requests
    assert len(calls) <= 12 + 1  # about one step per token, not one per request per token


async def test_a_three_stage_ring_with_origins_everywhere_gives_the_same_tokens(expected3) -> None:
    async with ring(3) as net:
        results = await together(net, list(net.nodes.values()))
        assert net.first.stage.active_requests() == 0
    assert results == expected3
    assert all(isinstance(m, (Submit, Forward, Sampled, Tokens, Release, Error)) for m in net.sent)


async def test_requests_arriving_apart_decode_together_on_one_machine(expected3) -> None:
    async with ring(3, delays=(0.005, 0.005, 0.005)) as net:
        async def later(i: int, rid: str) -> list[int]:
            await asyncio.sleep(0.004 * i)  # each arrives while the batch before it is going round
            return await generate(net.first, rid, PROMPTS[rid])

        results = await asyncio.gather(*(later(i, rid) for i, rid in enumerate(list(PROMPTS)[:4])))
        calls = net.first.engine.calls
    assert results == [expected3[rid] for rid in list(PROMPTS)[:4]]
    assert len(calls[-4]) == 4  # near the end, all four decode in one batch rather than in turns


async def test_stages_on_separate_machines_keep_several_batches_in_flight(expected3) -> None:
    async with ring(3, depth=3, delays=(0.01, 0.01, 0.01)) as net:
        results = await together(net)
        first = net.first.engine.calls
    assert results == expected3
    decode_steps = [call for call in first if all(count == 1 for _, _, count in call)]
    assert max(len(call) for call in decode_steps) <= 3  # eight decoding requests, three batches in turn


async def test_a_busy_stage_runs_queued_batches_together(expected3) -> None:
    limits = SchedulerLimits(max_batch_tokens=8)  # small steps, so batches queue up behind the slow stage
    async with ring(3, limits=limits, delays=(0.0, 0.02, 0.0)) as net:
        results = await together(net)
        middle = net.nodes["n1"].engine.calls
    assert results == expected3
    assert max(len(call) for call in middle) > 1


async def test_a_small_kv_budget_queues_and_preempts_without_changing_any_text(expected) -> None:
    async with ring(kv_blocks=6, limits=SchedulerLimits(256, prefix_cache=False)) as net:
        results = await together(net)
        scheduler = net.first.stage.scheduler
        assert scheduler.preemptions > 0
        assert scheduler.pool.available == 6 and not scheduler.running
    assert results == expected


async def test_a_prefix_hit_computes_only_the_rest_and_changes_nothing() -> None:
    shared = list(range(40))
    async with ring(3) as net:
        first = await generate(net.first, "a", shared + [1, 2])
        second = await generate(net.first, "b", shared + [3])
        b_steps = [c for call in net.nodes["n2"].engine.calls for c in call if c[0] == "b"]
        hits = net.first.stage.scheduler.prefix_hits
    async with ring(3, limits=SchedulerLimits(prefix_cache=False)) as net:
        assert await generate(net.first, "a", shared + [1, 2]) == first
        assert await generate(net.first, "b", shared + [3]) == second
    assert hits == 32
    assert b_steps[0] == ("b", 32, 9)  # two cached blocks; every stage computes only the other 9 positions


async def test_cancelling_one_request_mid_batch_frees_it_and_spares_the_others(expected3) -> None:
    async with ring(3, delays=(0.0, 0.005, 0.0)) as net:
        async def cancelled() -> None:
            async with contextlib.aclosing(net.first.origin.generate("gone", list(range(30)),
                                                                     SamplingParams(temperature=0.0), 50, ())) as s:
                async for _ in s:
                    break  # the client goes away after the first token

        results, _ = await asyncio.gather(together(net), cancelled())
        await asyncio.sleep(0.2)
        scheduler = net.first.stage.scheduler
        assert "gone" not in scheduler.running and not scheduler.running
        assert any(isinstance(m, Release) and m.rid == "gone" for m in net.sent)
    assert results == expected3


async def test_a_failing_step_fails_its_requests_clearly_and_the_ring_keeps_serving(expected3) -> None:
    async with ring(3) as net:
        net.nodes["n1"].engine.fail_on = "bad"
        with pytest.raises(ExoLikeError, match="fake engine broke") as failure:
            await generate(net.first, "bad", [1, 2, 3])
        assert failure.value.code == "stage_failed"
        await asyncio.sleep(0.1)
        assert net.first.stage.active_requests() == 0  # freed at the first stage
        assert await generate(net.first, "r3", PROMPTS["r3"]) == expected3["r3"]


async def test_seeded_sampling_is_the_same_alone_and_in_a_batch() -> None:
    sampling = SamplingParams(temperature=5.0, seed=1234)  # the fake logits are one-hot: a high temperature spreads

    async def run(concurrent: bool) -> list[int]:
        async with ring(3) as net:
            job = generate(net.first, "s", [5, 6, 7], 20, sampling)
            if not concurrent:
                return await job
            results = await asyncio.gather(job, together(net))
            return results[0]

    alone = await run(False)
    assert alone == await run(True)
    assert len(set(alone)) > 3


async def test_a_request_for_another_plan_is_refused_at_once() -> None:
    async with ring() as net:
        got: list[Message] = []
        net.first.origin.handle = got.append  # type: ignore[method-assign]
        net.first.stage.handle(Submit("x", "n0", "other-digest", (1, 2), SampleSpec(0.0, 1.0, 0, 1, 5, (), 2)))
        await asyncio.sleep(0.05)
        assert [(m.rid, m.code) for m in got] == [("x", "plan_changed")]  # type: ignore[attr-defined]
