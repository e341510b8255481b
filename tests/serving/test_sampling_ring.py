"""Penalties and log-probabilities on a ring (tests/fake_ring.py): the last stage samples with the request's token
history, which the first stage sends with the request's first sampled token (and again after a preemption or on a
new ring); a request's tokens and log-probabilities are the same alone, batched with others, preempted, and
replayed after a node loss; the last stage holds no history once requests end or are cancelled."""

from __future__ import annotations

import asyncio
import contextlib

from exo_like.serving.sampling import Choice, SamplingParams
from exo_like.serving.scheduler import SchedulerLimits
from tests.fake_ring import FakeNetwork, FakeNode, ring

PROMPT = [5, 17, 3, 88, 41, 9, 60, 5, 5]
TOKENS = 40
PENALIZED = SamplingParams(temperature=0.0, presence_penalty=2.0, logprobs=2)
SAMPLED = SamplingParams(temperature=0.9, seed=5, frequency_penalty=0.8, repetition_penalty=1.3,
                         logit_bias=((3, 1.5),), min_p=0.05, logprobs=3)
OTHERS = {f"other{i}": list(range(i, i + 20)) for i in range(4)}


async def choices(origin: FakeNode, rid: str, sampling: SamplingParams, prompt: list[int] = PROMPT,
                  action_at: int = -1, action=None) -> list[Choice]:  # noqa: ANN001
    got: list[Choice] = []
    async with contextlib.aclosing(origin.origin.generate(rid, prompt, sampling, TOKENS, ())) as stream:
        async for choice in stream:
            got.append(choice)
            if len(got) == action_at and action is not None:
                action()
    return got


async def alone(sampling: SamplingParams) -> list[Choice]:
    async with ring(3) as net:
        result = await choices(net.first, "a", sampling)
        assert not any(node.stage.sampler_states for node in net.nodes.values())
        return result


async def test_a_presence_penalty_keeps_greedy_tokens_from_repeating() -> None:
    """The fake model's logits are one-hot: a generated token's logit drops to 1 - 2 < 0 below every unseen one's."""
    plain = [c.token for c in await alone(SamplingParams(temperature=0.0))]
    assert len(set(plain)) < len(plain)  # without the penalty the fake model repeats itself
    penalized = await alone(PENALIZED)
    tokens = [c.token for c in penalized]
    assert len(set(tokens)) == len(tokens)
    for choice in penalized:  # greedy: the chosen token is the likeliest, its log-probability the first listed
        assert choice.top_logprobs[0] == (choice.token, choice.logprob) and choice.logprob < 0


async def together(net: FakeNetwork, sampling: SamplingParams) -> list[Choice]:
    others = [choices(net.first, rid, SamplingParams(temperature=0.0), prompt) for rid, prompt in OTHERS.items()]
    ours, *_ = await asyncio.wait_for(asyncio.gather(choices(net.first, "a", sampling), *others), 30)
    return ours


async def test_batched_and_preempted_requests_sample_as_alone() -> None:
    for sampling in (PENALIZED, SAMPLED):
        expected = await alone(sampling)
        async with ring(3, kv_blocks=8, limits=SchedulerLimits(256, prefix_cache=False)) as net:
            assert await together(net, sampling) == expected
            assert net.first.stage.scheduler.preemptions > 0
            await asyncio.sleep(0.05)
            assert not any(node.stage.sampler_states for node in net.nodes.values())


async def test_a_request_replayed_on_a_new_ring_samples_as_alone() -> None:
    for sampling in (PENALIZED, SAMPLED):
        expected = await alone(sampling)
        async with ring(3, spares=1) as net:
            def lose() -> None:
                net.lose("n1")
                asyncio.get_running_loop().call_later(0.05, net.replan, ["n0", "n3", "n2"])
            assert await asyncio.wait_for(choices(net.nodes["n0"], "a", sampling, action_at=12, action=lose),
                                          10) == expected


async def test_a_cancelled_request_leaves_no_history_on_the_last_stage() -> None:
    async with ring(3, delays=(0.0, 0.005, 0.0)) as net:
        async with contextlib.aclosing(net.first.origin.generate("gone", PROMPT, PENALIZED, TOKENS, ())) as s:
            async for _ in s:
                assert net.nodes["n2"].stage.sampler_states  # the last stage keeps it while the request runs
                break  # the client goes away after the first token
        await asyncio.sleep(0.2)
        assert not net.nodes["n2"].stage.sampler_states
