"""Replay in-process (tests/fake_ring.py): a request whose ring breaks under it pauses, waits for the next plan and
resumes there with its tokens so far, giving exactly the tokens of an uninterrupted run.

The fake model's tokens depend on every position's KV in every stage, so a replay that skipped, repeated or
mis-placed a token would change everything after it. Nodes taken off the network keep running (like a frozen
process that wakes up): whatever they still send belongs to an abandoned attempt and must be ignored.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Callable

import pytest

from exo_like.cluster.protocol import Submit, Tokens
from exo_like.errors import ServiceUnavailableError
from exo_like.serving.sampling import SamplingParams
from tests.fake_ring import VOCAB, FakeNetwork, FakeNode, generate, ring

GREEDY = SamplingParams(temperature=0.0)
PROMPT = [5, 17, 3, 88, 41, 9, 60]
TOKENS = 40
BREAK_AT = 12  # tokens received before the ring breaks
REQUEST_WAIT = 0.3  # how long a request whose ring broke waits for a new one, where a test waits it out
HANG_SECONDS = 60.0  # only a guard against hanging: nothing asserted depends on how fast this machine is


async def stream(origin: FakeNode, rid: str, prompt: list[int] = PROMPT, max_tokens: int = TOKENS,
                 sampling: SamplingParams = GREEDY, at: int = BREAK_AT,
                 action: Callable[[], None] | None = None) -> list[int]:
    """The request's tokens; `action` runs once `at` tokens have arrived (the stream still open)."""
    tokens = []
    generator = origin.origin.generate(rid, prompt, sampling, max_tokens, ())
    async with contextlib.aclosing(generator) as tokens_in:
        async for choice in tokens_in:
            tokens.append(choice.token)
            if len(tokens) == at and action is not None:
                action()
    return tokens


async def uninterrupted(n_stages: int = 3, sampling: SamplingParams = GREEDY) -> list[int]:
    async with ring(n_stages) as net:
        return await generate(net.first, "ref", PROMPT, TOKENS, sampling)


def lose_then_replan(net: FakeNetwork, lost: str, ids: list[str], delay: float = 0.05) -> Callable[[], None]:
    """The node goes; a moment later the remaining nodes agree on a plan without it."""
    def act() -> None:
        net.lose(lost)
        asyncio.get_running_loop().call_later(delay, net.replan, ids)
    return act


@pytest.mark.parametrize("lost, origin, new_ring", [
    ("n1", "n0", ["n0", "n3", "n2"]),  # the middle stage
    ("n2", "n0", ["n0", "n1", "n3"]),  # the last stage (it samples)
    ("n0", "n2", ["n3", "n1", "n2"]),  # the first stage (it schedules), with another node as origin
])
async def test_a_lost_stage_costs_the_request_nothing(lost: str, origin: str, new_ring: list[str]) -> None:
    expected = await uninterrupted()
    async with ring(3, spares=1) as net:
        tokens = await asyncio.wait_for(
            stream(net.nodes[origin], "a", action=lose_then_replan(net, lost, new_ring)), HANG_SECONDS)
        assert tokens == expected
        generator = net.nodes[origin].origin
        assert generator.replays_total == 1 and not generator.in_flight
        assert net.first.stage.active_requests() == 0  # the replay's blocks are freed at the new first stage


async def test_a_replan_without_a_loss_replays_and_ignores_the_old_rings_frames() -> None:
    """A node joining makes every stage re-plan; the old ring's frames still in flight are dropped everywhere."""
    expected = await uninterrupted()
    async with ring(3) as net:
        tokens = await asyncio.wait_for(stream(net.nodes["n0"], "a", action=lambda: net.replan(["n1", "n2", "n0"])),
                                        HANG_SECONDS)
        assert tokens == expected
        assert net.nodes["n0"].origin.replays_total == 1


async def test_a_seeded_sampled_request_continues_its_random_stream() -> None:
    sampling = SamplingParams(temperature=5.0, seed=4321)  # the fake logits are one-hot: a high temperature spreads
    expected = await uninterrupted(sampling=sampling)
    assert len(set(expected)) > 5
    async with ring(3, spares=1) as net:
        tokens = await asyncio.wait_for(stream(net.nodes["n0"], "s", sampling=sampling,
                                               action=lose_then_replan(net, "n1", ["n0", "n3", "n2"])), HANG_SECONDS)
    assert tokens == expected


async def test_concurrent_requests_all_replay_and_each_matches_its_run_alone() -> None:
    prompts = {f"r{i}": [(11 * i + j) % VOCAB for j in range(2 + 3 * i)] for i in range(6)}
    expected = {}
    for rid, prompt in prompts.items():
        async with ring(3) as net:
            expected[rid] = await generate(net.first, rid, prompt, TOKENS)
    async with ring(3, spares=1) as net:
        act = lose_then_replan(net, "n1", ["n0", "n3", "n2"])
        jobs = [stream(net.nodes["n0"], rid, prompt, action=act if rid == "r0" else None)
                for rid, prompt in prompts.items()]
        results = await asyncio.wait_for(asyncio.gather(*jobs), 20)
    assert dict(zip(prompts, results)) == expected


async def test_a_paused_request_shows_what_it_lost_while_it_waits() -> None:
    async with ring(3, spares=1) as net:
        origin = net.nodes["n0"].origin
        seen: list[dict] = []

        def lose() -> None:
            net.lose("n1")
            asyncio.get_running_loop().call_later(0.2, lambda: seen.append(
                {**origin.in_flight["a"].to_json(), "by_lost_node": origin.recovering()}))
            asyncio.get_running_loop().call_later(0.3, net.replan, ["n0", "n3", "n2"])

        await asyncio.wait_for(stream(net.nodes["n0"], "a", action=lose), HANG_SECONDS)
    assert seen[0]["replays"] == 1 and seen[0]["lost_nodes"] == ["n1"] and seen[0]["by_lost_node"] == {"n1": 1}
    assert "node n1 (n1) left the cluster" in seen[0]["recovering"]
    assert origin.recovering() == {} and origin.stats()["replays_total"] == 1


async def test_without_a_new_ring_the_request_fails_within_the_wait_naming_the_lost_node() -> None:
    """Within the wait: the paused request waits for a ring once, for no longer than its --request-wait, and
    fails when that wait ends (observed where the origin waits, not timed against a clock a busy machine
    stretches)."""
    async with ring(3, request_wait=REQUEST_WAIT) as net:
        origin = net.nodes["n0"].origin
        waits: list[float | None] = []  # the timeout of each wait for a plan, in order

        async def wait_for_plan(timeout: float | None):  # type: ignore[no-untyped-def]
            waits.append(timeout)
            return await net.wait_ready(timeout)

        origin.wait_for_plan = wait_for_plan
        with pytest.raises(ServiceUnavailableError) as failure:
            await asyncio.wait_for(stream(net.nodes["n0"], "a", action=lambda: net.lose("n1")), HANG_SECONDS)
    # The request's start (no ring lost yet: no limit), then the one wait after the loss, then the failure.
    assert len(waits) == 2 and waits[0] is None and 0 < waits[1] <= REQUEST_WAIT, waits
    assert failure.value.code == "plan_unavailable"
    assert "node n1 (n1) left the cluster" in failure.value.message and "could not be resumed" in failure.value.message


async def test_a_frozen_stage_that_wakes_after_the_replay_is_not_heard() -> None:
    """The last stage is lost in the middle of a step (frozen, say); it wakes up after the request moved on and
    sends the token it was computing. The origin must not stream it: the new ring sends that token itself."""
    expected = await uninterrupted()
    async with ring(3, spares=1, delays=(0.0, 0.0, 0.2)) as net:
        lose = lose_then_replan(net, "n2", ["n0", "n1", "n3"])
        # Lost halfway through its next 0.2 s step.
        tokens = await asyncio.wait_for(stream(net.nodes["n0"], "a", action=lambda: asyncio.get_running_loop(
            ).call_later(0.1, lose)), 20)
        await asyncio.sleep(0.3)  # the lost stage's last step ends, and its token goes out
    assert tokens == expected
    replay = next(m for m in net.sent if isinstance(m, Submit) and m.rid != "a")
    taken_before = len(replay.tokens) - len(PROMPT)  # what the origin had streamed when it replayed
    sent_before = sum(1 for m in net.sent if isinstance(m, Tokens) for t in m.tokens if t.rid == "a")
    assert sent_before > taken_before  # the woken stage's token did reach the origin, which ignored it


async def test_when_the_rest_cannot_hold_the_model_the_request_fails_at_once_saying_why() -> None:
    async with ring(3) as net:
        def lose() -> None:
            net.lose("n1")
            net.problem = "the model does not fit: 2 nodes hold 1.0 GB, the model needs 1.5 GB"

        with pytest.raises(ServiceUnavailableError) as failure:
            await asyncio.wait_for(stream(net.nodes["n0"], "a", action=lose), 5)
    assert failure.value.message == ("node n1 (n1) left the cluster during the request; the request could not be "
                                     "resumed on the remaining nodes: the model does not fit: 2 nodes hold 1.0 GB, "
                                     "the model needs 1.5 GB")


async def test_a_step_still_queued_when_its_stage_leaves_the_plan_is_dropped_not_failed() -> None:
    """The engine thread is busy (a cancelled load, say) while a step waits for it, and the stage is re-planned
    out of the ring meanwhile: that step must not fail its requests; they replay on the new ring."""
    expected = await uninterrupted()
    async with ring(3, spares=1, delays=(0.05, 0.0, 0.0)) as net:  # the next step reaches n1 after the block
        middle = net.nodes["n1"]

        def act() -> None:
            middle.executor.submit(time.sleep, 0.3)  # the step for the next token queues behind this
            asyncio.get_running_loop().call_later(0.1, net.replan, ["n0", "n3", "n2"])

        tokens = await asyncio.wait_for(stream(net.nodes["n0"], "a", action=act), HANG_SECONDS)
    assert tokens == expected
