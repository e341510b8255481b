"""Stages and origins in one process (tests/fake_ring.py): continuous batching, ordering across a three-stage ring,
cancellation mid-batch, prefix hits, a small KV budget, batches merged on a busy stage, and a failing engine."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Sequence

import pytest

import exo_like.serving.stage as stage_module
from exo_like.cluster.protocol import Error, Forward, Message, Release, Sampled, Submit, Tokens
from exo_like.engines.activations import Activations
from exo_like.engines.work import SampleSpec, SamplingParams, WorkItem
from exo_like.errors import ExoLikeError
from exo_like.serving.scheduler import Scheduler, SchedulerLimits
from tests.fake_ring import VOCAB, FakeNetwork, FakeNode, generate, ring

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


class CountingScheduler(Scheduler):
    """A scheduler that records, as each step is sent off, how many batches await their tokens (its own
    included)."""

    def __init__(self, *args, **kwargs) -> None:  # noqa: ANN002, ANN003
        super().__init__(*args, **kwargs)
        self.out: list[int] = []

    def schedule(self):  # type: ignore[no-untyped-def]
        step = super().schedule()
        if step is not None:
            self.out.append(self.batches_in_flight())
        return step


async def test_stages_on_separate_machines_keep_several_batches_in_flight(expected3, monkeypatch) -> None:
    monkeypatch.setattr(stage_module, "Scheduler", CountingScheduler)
    async with ring(3, depth=3, delays=(0.01, 0.01, 0.01)) as net:
        results = await together(net)
        first = net.first.engine.calls
        out = net.first.stage.scheduler.out
    assert results == expected3
    # Several batches in flight at once (a step sent off while others still await their tokens), never more than
    # the pipeline's depth.
    assert max(out) > 1 and max(out) <= 3, out
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


async def test_a_batch_sent_to_the_first_stage_is_dropped_and_the_ring_keeps_serving(expected3) -> None:
    """Only a faulty or foreign peer sends one: the first stage schedules and never reads batches, so keeping it
    would hold its memory, and the stage would look busy, for as long as the plan lasts."""
    async with ring(3) as net:
        plan = await net.wait_ready(5)
        item = WorkItem("stray", "n1", 0, 2, (0,))
        net.first.stage.handle(Forward(plan.digest, (item,), Activations("float32", (2, 4), bytes(32))))
        assert await generate(net.first, "r3", PROMPTS["r3"]) == expected3["r3"]
        await asyncio.sleep(1.1)  # past the last step's second
        assert not net.first.stage.busy()


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
        spec = SampleSpec(SamplingParams(0.0, seed=1), 5, (), 2)
        net.first.stage.handle(Submit("x", "n0", "other-digest", (1, 2), spec))
        await asyncio.sleep(0.05)
        assert [(m.rid, m.code) for m in got] == [("x", "plan_changed")]  # type: ignore[attr-defined]
