"""The first stage's scheduler, in-process: batching, ordering, chunked prefill, admission under a KV budget,
preemption, the prefix cache as the scheduler uses it, release mid-flight (the pools and the KV cache manager
alone: test_kv_cache.py)."""

from __future__ import annotations

import pytest

from exo_like.engines.work import BLOCK_SIZE, SampleSpec, SamplingParams
from exo_like.serving.scheduler import Scheduler, SchedulerLimits


def spec(prompt_len: int, max_tokens: int = 100) -> SampleSpec:
    return SampleSpec(SamplingParams(0.0, seed=7), max_tokens, (), prompt_len)


def submit(scheduler: Scheduler, rid: str, tokens: list[int], max_tokens: int = 100) -> None:
    scheduler.submit(rid, "origin", tokens, spec(len(tokens), max_tokens))


def run_step(scheduler: Scheduler, next_token: int = 5) -> dict[str, tuple[int, int]]:
    """Schedule one step and feed back a token for every sampled item; {rid: (start, count)}."""
    step = scheduler.schedule()
    assert step is not None
    for item in step.items:
        if item.sample is not None:
            scheduler.on_sampled(item.rid, [next_token], done=False)
    return {item.rid: (item.start, item.count) for item in step.items}


# -- batching ---------------------------------------------------------------------------------------------


def test_a_step_runs_every_ready_request_decode_first() -> None:
    scheduler = Scheduler(64)
    submit(scheduler, "a", list(range(10)))
    submit(scheduler, "b", list(range(20, 27)))
    assert run_step(scheduler) == {"a": (0, 10), "b": (0, 7)}  # both prompts in one step
    submit(scheduler, "c", list(range(40, 45)))
    step = scheduler.schedule()
    assert [(i.rid, i.start, i.count) for i in step.items] == [("a", 10, 1), ("b", 7, 1), ("c", 0, 5)]
    assert step.tokens.tolist() == [5, 5, 40, 41, 42, 43, 44]
    assert all(item.sample is not None for item in step.items)


def test_a_long_prompt_is_chunked_under_the_token_budget_while_others_decode() -> None:
    scheduler = Scheduler(256, SchedulerLimits(max_batch_tokens=32))
    submit(scheduler, "short", [1, 2, 3])
    run_step(scheduler)
    submit(scheduler, "long", list(range(100)))
    seen = []
    for _ in range(5):
        seen.append(run_step(scheduler))
    # Every step the short request decodes, and the long prompt gets the rest of the budget.
    assert [s["short"][1] for s in seen] == [1, 1, 1, 1, 1]
    assert [s["long"] for s in seen[:4]] == [(0, 31), (31, 31), (62, 31), (93, 7)]
    assert seen[4]["long"] == (100, 1)  # then it decodes too
    step_items = scheduler.schedule().items
    assert {i.rid for i in step_items} == {"short", "long"}


def test_chunks_late_in_a_long_prompt_are_smaller() -> None:
    """A prompt token's attention grows with its position: it weighs (1 + position // scale) in the budget."""
    scheduler = Scheduler(256, SchedulerLimits(max_batch_tokens=32), attention_scale=100)
    submit(scheduler, "short", [1, 2])
    run_step(scheduler)
    submit(scheduler, "long", list(range(300)))
    chunks = [run_step(scheduler)["long"] for _ in range(7)]
    assert chunks[:5] == [(0, 31), (31, 31), (62, 31), (93, 31), (124, 15)]  # weight 2 from position 100 on
    assert chunks[6] == (154, 15) and scheduler.running["short"].computed == 9  # short decoded every step


def test_a_long_prompt_holds_one_run_of_blocks_while_streams_grow_around_it() -> None:
    """Blocks for the whole prompt come at admission, consecutive: its chunks attend to a view of the pool."""
    scheduler = Scheduler(256, SchedulerLimits(max_batch_tokens=32))
    for rid in ("s1", "s2"):
        submit(scheduler, rid, list(range(BLOCK_SIZE - 2)))
    run_step(scheduler)
    submit(scheduler, "long", list(range(10 * BLOCK_SIZE)))
    for _ in range(12):  # the streams each take a new block while the prompt is chunked
        run_step(scheduler)
    assert len(scheduler.running["s1"].kv.blocks) == 2
    prompt_blocks = scheduler.running["long"].kv.blocks[:10]
    assert prompt_blocks == list(range(prompt_blocks[0], prompt_blocks[0] + 10))


def test_a_prompt_too_deep_for_any_chunk_still_moves_a_token_at_a_time() -> None:
    scheduler = Scheduler(256, SchedulerLimits(max_batch_tokens=64, interleave_tokens=4), attention_scale=1)
    submit(scheduler, "short", [1])
    run_step(scheduler)  # now streaming
    submit(scheduler, "deep", list(range(20)))
    assert [run_step(scheduler)["deep"] for _ in range(3)] == [(0, 4), (4, 1), (5, 1)]


def test_with_nobody_streaming_a_prompt_goes_in_big_chunks() -> None:
    scheduler = Scheduler(256, SchedulerLimits(max_batch_tokens=64, interleave_tokens=4), attention_scale=1)
    submit(scheduler, "alone", list(range(100)))
    assert [run_step(scheduler)["alone"] for _ in range(2)] == [(0, 64), (64, 36)]


def test_a_replayed_request_recomputes_its_generated_tokens_in_big_chunks() -> None:
    """A request resumed on a new ring brings its generated tokens along: they are prefill, not a stream, so they
    do not shrink the step to the small chunks meant to keep streams flowing."""
    scheduler = Scheduler(64, SchedulerLimits(max_batch_tokens=512, interleave_tokens=32))
    tokens = list(range(600))
    scheduler.submit("replayed", "origin", tokens, spec(100))  # 500 generated already
    assert [run_step(scheduler) for _ in range(3)] == [
        {"replayed": (0, 512)}, {"replayed": (512, 88)}, {"replayed": (600, 1)}]  # then it streams on


def test_only_the_chunk_that_ends_the_prompt_samples() -> None:
    scheduler = Scheduler(64, SchedulerLimits(max_batch_tokens=8))
    submit(scheduler, "a", list(range(20)))
    samples = []
    for _ in range(3):
        step = scheduler.schedule()
        samples.append(step.items[0].sample is not None)
    assert samples == [False, False, True]
    assert scheduler.schedule() is None  # its token is being sampled: nothing to do until it arrives
    scheduler.on_sampled("a", [9], done=False)
    assert scheduler.schedule().tokens.tolist() == [9]


def test_requests_beyond_max_running_wait_in_order() -> None:
    scheduler = Scheduler(64, SchedulerLimits(max_running=2))
    for rid in "abc":
        submit(scheduler, rid, [1, 2])
    assert set(run_step(scheduler)) == {"a", "b"}
    scheduler.on_sampled("a", [0], done=True)  # a finishes: c gets its place
    assert set(run_step(scheduler)) == {"b", "c"}


def test_done_and_release_free_the_blocks() -> None:
    scheduler = Scheduler(8, SchedulerLimits(max_batch_tokens=256))
    submit(scheduler, "a", list(range(40)))  # 3 blocks
    submit(scheduler, "b", list(range(100, 110)))
    run_step(scheduler)
    assert scheduler.pool.used == 4
    scheduler.on_sampled("b", [1], done=True)
    assert scheduler.pool.used == 3 and "b" not in scheduler.running
    assert scheduler.release("a") and not scheduler.release("a")
    assert scheduler.pool.available == 8 and not scheduler.running
    # A late token of a released request changes nothing.
    scheduler.on_sampled("a", [3], done=False)
    assert scheduler.schedule() is None


# -- the KV budget ----------------------------------------------------------------------------------------


def test_requests_wait_for_kv_blocks_and_are_admitted_as_others_finish() -> None:
    scheduler = Scheduler(4, SchedulerLimits(prefix_cache=False))  # 64 positions
    for rid in "abc":
        submit(scheduler, rid, list(range(30)))  # 2 blocks each
    assert set(run_step(scheduler)) == {"a", "b"}
    assert [s.rid for s in scheduler.waiting] == ["c"]
    scheduler.on_sampled("a", [0], done=True)
    assert set(run_step(scheduler)) == {"b", "c"}
    assert not scheduler.failures


def test_a_request_that_needs_a_block_preempts_the_newest_one() -> None:
    scheduler = Scheduler(2, SchedulerLimits(prefix_cache=False))
    submit(scheduler, "old", list(range(BLOCK_SIZE - 1)))  # fills its block with the first token
    submit(scheduler, "new", list(range(5)))
    run_step(scheduler)
    step = run_step(scheduler)  # old decodes at position 15 (its block's last slot), new at 5
    assert step == {"old": (15, 1), "new": (5, 1)}
    step = run_step(scheduler)  # old needs a second block: new gives its up and waits, keeping its tokens
    assert step == {"old": (16, 1)}
    assert scheduler.preemptions == 1 and [s.rid for s in scheduler.waiting] == ["new"]
    assert scheduler.waiting[0].tokens == [0, 1, 2, 3, 4, 5, 5]
    scheduler.on_sampled("old", [0], done=True)
    # Recomputed from all its tokens; it samples its next token at the same index as before.
    step = scheduler.schedule()
    assert [(i.rid, i.start, i.count) for i in step.items] == [("new", 0, 7)]
    assert step.items[0].end - step.items[0].sample.prompt_len == 2


def test_in_flight_requests_are_not_preempted() -> None:
    scheduler = Scheduler(2, SchedulerLimits(prefix_cache=False))
    submit(scheduler, "old", list(range(BLOCK_SIZE)))
    submit(scheduler, "new", list(range(3)))
    scheduler.schedule()  # both in flight now
    scheduler.on_sampled("old", [1], done=False)
    assert scheduler.schedule() is None  # old needs a block, new's token is still being sampled
    scheduler.on_sampled("new", [1], done=False)
    assert run_step(scheduler) == {"old": (16, 1)}


def test_a_prompt_longer_than_the_ring_can_hold_fails_clearly() -> None:
    scheduler = Scheduler(2)
    submit(scheduler, "big", list(range(2 * BLOCK_SIZE)))
    assert scheduler.schedule() is None
    [failure] = scheduler.failures
    assert failure.code == "context_length_exceeded" and "--kv-cache-gb" in failure.message


def test_a_request_alone_that_outgrows_the_pool_fails_clearly() -> None:
    scheduler = Scheduler(1)
    submit(scheduler, "a", list(range(BLOCK_SIZE - 1)))
    run_step(scheduler)
    run_step(scheduler)  # position 15, the last slot
    assert scheduler.schedule() is None
    [failure] = scheduler.failures
    assert failure.code == "kv_cache_full" and not scheduler.running and scheduler.pool.available == 1


# -- pipelining -------------------------------------------------------------------------------------------


def test_with_several_machines_decoding_requests_split_into_batches_in_flight() -> None:
    scheduler = Scheduler(64, pipeline_depth=3)
    for rid in "abcdefgh":
        submit(scheduler, rid, [1, 2, 3])
    first = scheduler.schedule()
    assert len(first.items) == 8  # prompts go together
    for item in first.items:
        scheduler.on_sampled(item.rid, [4], done=False)
    sizes = []
    while (step := scheduler.schedule()) is not None:
        sizes.append(len(step.items))
    assert sizes == [3, 3, 2]  # three batches, one per stage machine, all in flight at once


def test_with_one_machine_one_batch_is_in_flight_so_requests_stay_together() -> None:
    scheduler = Scheduler(64)
    submit(scheduler, "a", [1, 2, 3])
    first = scheduler.schedule()
    submit(scheduler, "b", [4, 5])  # arrives while a's first token is being sampled
    assert scheduler.schedule() is None and scheduler.batches_in_flight() == 1
    scheduler.on_sampled("a", [9], done=False)
    step = scheduler.schedule()
    assert [(i.rid, i.count) for i in step.items] == [("a", 1), ("b", 2)]  # one batch from here on
    assert first.items[0].rid == "a"


def test_with_two_machines_a_second_batch_goes_while_the_first_is_out() -> None:
    scheduler = Scheduler(64, pipeline_depth=2)
    submit(scheduler, "a", [1, 2, 3])
    scheduler.schedule()
    submit(scheduler, "b", [4, 5])
    assert [i.rid for i in scheduler.schedule().items] == ["b"]
    submit(scheduler, "c", [6])
    assert scheduler.schedule() is None  # two batches out: c waits for one of them


# -- the prefix cache -------------------------------------------------------------------------------------


def test_a_prompt_sharing_a_cached_prefix_computes_only_the_rest() -> None:
    scheduler = Scheduler(64, SchedulerLimits(max_batch_tokens=256))
    system = list(range(1000, 1000 + 5 * BLOCK_SIZE + 3))  # 5 full blocks and 3 more tokens
    submit(scheduler, "first", system + [1, 2, 3])
    run_step(scheduler)
    scheduler.on_sampled("first", [0], done=True)  # finished: its full blocks stay cached
    assert scheduler.pool.cached == 5
    submit(scheduler, "second", system + [7, 8])
    step = scheduler.schedule()
    [item] = step.items
    assert (item.start, item.count) == (5 * BLOCK_SIZE, 5)
    assert step.tokens.tolist() == system[-3:] + [7, 8]
    assert (scheduler.prefix_hits, scheduler.prefix_queries) == (5 * BLOCK_SIZE, len(system) + 3 + len(system) + 2)


def test_a_request_waiting_for_blocks_is_counted_once_in_the_prefix_cache_figures() -> None:
    scheduler = Scheduler(3, SchedulerLimits(max_batch_tokens=256))
    submit(scheduler, "a", list(range(40)))  # all three blocks (positions up to 47)
    submit(scheduler, "b", list(range(50, 60)))
    run_step(scheduler)
    for _ in range(3):
        run_step(scheduler)  # a decodes; b waits, its lookup tried each step but not counted
    assert scheduler.prefix_queries == 40 and [s.rid for s in scheduler.waiting] == ["b"]
    scheduler.release("a")
    run_step(scheduler)
    assert scheduler.prefix_queries == 50


def test_a_prompt_entirely_cached_still_computes_its_last_block() -> None:
    scheduler = Scheduler(64)
    prompt = list(range(2 * BLOCK_SIZE))
    submit(scheduler, "a", prompt)
    run_step(scheduler)
    scheduler.on_sampled("a", [0], done=True)
    submit(scheduler, "b", prompt)
    [item] = scheduler.schedule().items
    assert (item.start, item.count) == (BLOCK_SIZE, BLOCK_SIZE)  # the logits of the last token are needed


def test_running_requests_share_cached_blocks_and_never_write_them() -> None:
    scheduler = Scheduler(64, SchedulerLimits(max_batch_tokens=256))
    prefix = list(range(3 * BLOCK_SIZE))
    submit(scheduler, "a", prefix + [1])
    run_step(scheduler)
    submit(scheduler, "b", prefix + [2])
    step = scheduler.schedule()
    items = {i.rid: i for i in step.items}
    shared = items["a"].blocks[:3]
    assert items["b"].blocks[:3] == shared
    assert items["b"].start == 3 * BLOCK_SIZE  # writes start after the shared blocks
    assert items["a"].start >= 3 * BLOCK_SIZE
    scheduler.release("a")
    assert scheduler.pool.used >= 4  # b still holds the shared blocks


def test_with_the_prefix_cache_off_nothing_is_shared() -> None:
    scheduler = Scheduler(64, SchedulerLimits(prefix_cache=False))
    prompt = list(range(3 * BLOCK_SIZE + 1))
    submit(scheduler, "a", prompt)
    run_step(scheduler)
    scheduler.on_sampled("a", [0], done=True)
    submit(scheduler, "b", prompt)
    [item] = scheduler.schedule().items
    assert item.start == 0 and scheduler.pool.cached == 0


def test_plan_change_drains_every_request() -> None:
    scheduler = Scheduler(64)
    submit(scheduler, "a", [1, 2])
    submit(scheduler, "b", [3])
    scheduler.schedule()
    submit(scheduler, "c", [4])
    drained = scheduler.drain()
    assert sorted(s.rid for s in drained) == ["a", "b", "c"]
    assert not scheduler.running and not scheduler.waiting and scheduler.pool.available == 64


def test_limits_are_checked_and_the_step_budget_follows_the_device() -> None:
    with pytest.raises(ValueError):
        SchedulerLimits(max_batch_tokens=0)
    cpu, accelerator = Scheduler(8, cpu=True).limits, Scheduler(8, cpu=False).limits
    assert (cpu.max_batch_tokens, cpu.interleave_tokens) == (512, 32)
    assert (accelerator.max_batch_tokens, accelerator.interleave_tokens) == (2048, 512)
    small = Scheduler(8, SchedulerLimits(max_batch_tokens=7), cpu=False).limits
    assert (small.max_batch_tokens, small.interleave_tokens) == (7, 7)
