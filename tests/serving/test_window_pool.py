"""The sliding-window layers' KV pool: tables that hold only the blocks a request's window reaches (scheduler.py),
through the in-process ring (tests/fake_ring.py), and how a stage splits its budget between the pools.

The fake engine mixes in what its window pool holds at each row's last WINDOW positions. The reference reads those
positions from the other pool instead (which keeps every position), so it does not depend on window tables at all:
a window block handed out twice, given back while the window still reaches it, or reused before every stage read
it changes the tokens."""

from __future__ import annotations

import asyncio

import pytest

from exo_like.engines.work import BLOCK_SIZE, KVPoolSize, blocks_for, window_start
from exo_like.serving.kv_blocks import WINDOW_REQUESTS, pool_sizes
from exo_like.serving.scheduler import Scheduler, SchedulerLimits
from tests.fake_ring import VOCAB, FakeEngine, generate, ring
from tests.serving.test_replay import lose_then_replan, stream
from tests.serving.test_scheduler import submit

WINDOW = 20  # not a multiple of the block size: a window spans two or three blocks
PROMPTS = {f"w{i}": [(11 * i + j) % VOCAB for j in range(5 + 9 * i)] for i in range(8)}  # 5 to 68 tokens
NEW_TOKENS = 24


async def run_all(**kwargs) -> dict[str, list[int]]:  # noqa: ANN003
    async with ring(3, window=WINDOW, **kwargs) as net:
        tasks = [generate(net.first, rid, prompt, NEW_TOKENS) for rid, prompt in PROMPTS.items()]
        results = dict(zip(PROMPTS, await asyncio.wait_for(asyncio.gather(*tasks), 60)))
        scheduler = net.first.stage.scheduler
        assert not scheduler.running and scheduler.window_pool.used == scheduler.window_pool.cached
        run_all.preemptions = scheduler.preemptions  # type: ignore[attr-defined]
        run_all.widest = max(len(t) for e in engines(net) for t in e.window_tables)  # type: ignore[attr-defined]
    return results


def engines(net) -> list[FakeEngine]:  # noqa: ANN001
    return [node.engine for node in net.nodes.values() if node.engine is not None]


@pytest.fixture(scope="module")
def reference() -> dict[str, list[int]]:
    """Each request alone, its window read from the pool that keeps every position."""
    async def alone() -> dict[str, list[int]]:
        results = {}
        for rid, prompt in PROMPTS.items():
            async with ring(3, window=WINDOW, window_blocks=256, window_from_full=True) as net:
                results[rid] = await generate(net.first, rid, prompt, NEW_TOKENS)
        return results
    return asyncio.run(alone())


async def test_concurrent_requests_through_a_small_window_pool_equal_the_reference(reference) -> None:
    # 8 requests need about 8 x 3 window blocks while decoding and more for their prompts: 12 makes them queue
    # and preempt one another for window blocks alone (the other pool has room for all).
    results = await run_all(window_blocks=12, limits=SchedulerLimits(256, prefix_cache=False))
    assert results == reference
    assert len({tuple(v) for v in reference.values()}) == 8
    assert run_all.preemptions > 0  # type: ignore[attr-defined]
    assert run_all.widest <= blocks_for(WINDOW) + 1  # type: ignore[attr-defined]  # decode rows: a window's blocks


async def test_the_prefix_cache_serves_both_pools_and_changes_nothing(reference) -> None:
    results = await run_all(window_blocks=64)
    assert results == reference


async def test_a_prefix_whose_window_blocks_were_evicted_is_recomputed_only_as_far_as_needed() -> None:
    shared = list(range(64))
    limits = SchedulerLimits(256)
    async with ring(1, window=WINDOW, window_blocks=64, limits=limits) as net:
        first = await asyncio.wait_for(generate(net.first, "a", shared + [1], 4), 30)
        scheduler = net.first.stage.scheduler
        # a's window blocks of positions 0-31 are evicted; those of 32-63 still serve b's window at position 64.
        for _ in range(2):
            scheduler.window_pool._evict_oldest()
        second = await asyncio.wait_for(generate(net.first, "b", shared + [2], 4), 30)
        b_start = next(call for call in net.first.engine.calls if call[0][0] == "b")[0][1]
        scheduler.window_pool.clear_cache()  # now b's window is gone: c computes from the start
        third = await asyncio.wait_for(generate(net.first, "c", shared + [3], 4), 30)
        c_start = next(call for call in net.first.engine.calls if call[0][0] == "c")[0][1]
    async with ring(1, window=WINDOW, window_blocks=256, window_from_full=True) as net:
        assert [await generate(net.first, rid, shared + [n], 4) for rid, n in (("a", 1), ("b", 2), ("c", 3))] == \
            [first, second, third]
    assert (b_start, c_start) == (64, 0)


def test_a_decoding_request_holds_only_its_windows_blocks() -> None:
    scheduler = Scheduler(64, SchedulerLimits(256), window=WINDOW, n_window_blocks=8)
    submit(scheduler, "r", list(range(100)), max_tokens=200)
    held = []
    for _ in range(60):
        step = scheduler.schedule()
        item = step.items[0]
        held.append((item.window_first, len(item.window_blocks)))
        assert item.window_first * BLOCK_SIZE <= window_start(item.start, WINDOW)
        scheduler.on_sampled("r", [5], False)
    assert held[0] == (0, blocks_for(100))  # the prompt in one step: its rows' windows reach back to position 0
    assert all(count <= blocks_for(WINDOW) + 1 for _, count in held[1:])
    scheduler.release("r")
    assert scheduler.window_pool.available == 8 and scheduler.pool.available == 64


def test_a_stage_gives_the_window_pool_what_its_requests_need_and_the_rest_to_the_other() -> None:
    # gpt-oss's shape: as many sliding-window as full-attention layers, a block costing 1 kB in each.
    budget = 10_000 * 2048
    size = pool_sizes(budget, (1024, 1024), 128, requests=64, step_rows=512, context_length=131072)
    windows = WINDOW_REQUESTS * (blocks_for(128) + 2) + blocks_for(512)
    assert size == KVPoolSize((budget - windows * 1024) // 1024, windows)
    assert size.blocks > budget // 2048  # more positions than one pool for all layers would hold
    assert pool_sizes(100 * 2048, (1024, 1024), 128, 64, 512, 4096) == KVPoolSize(100, 100)  # small: split evenly
    assert pool_sizes(budget, (1024, 1024), 128, 2, 512, 4096).window_blocks == 2 * 10 + 32  # --max-running 2
    assert pool_sizes(budget, (2048, 0), None, 64, 512, 4096) == KVPoolSize(10_000)  # no window
    # Only sliding-window layers here: the other pool holds nothing, its ids only name blocks.
    assert pool_sizes(budget, (0, 2048), 128, 64, 512, 4096) == KVPoolSize(64 * blocks_for(4096), 10_000)
    # A budget beyond what the running limit's whole contexts (and one step's chunk) could fill is not taken.
    fillable = 64 * blocks_for(4096) + blocks_for(512)
    assert pool_sizes(2**31, (2048, 0), None, 64, 512, 4096) == KVPoolSize(fillable)
    assert pool_sizes(2**31, (1024, 1024), 128, 64, 512, 4096).blocks == fillable
    assert pool_sizes(2**31, (2048, 0), None, 2, 512, 4096) == KVPoolSize(2 * blocks_for(4096) + blocks_for(512))


async def test_a_replay_on_a_new_ring_rebuilds_both_pools_and_costs_nothing(reference) -> None:
    prompt = PROMPTS["w5"]
    async with ring(3, window=WINDOW, window_blocks=16, spares=1) as net:
        tokens = await asyncio.wait_for(stream(net.nodes["n0"], "w5", prompt, NEW_TOKENS, at=10,
                                               action=lose_then_replan(net, "n1", ["n0", "n3", "n2"])), 10)
        assert net.nodes["n0"].origin.replays_total == 1
        scheduler = net.first.stage.scheduler
        assert not scheduler.running and scheduler.window_pool.used == scheduler.window_pool.cached
    assert tokens == reference["w5"]
