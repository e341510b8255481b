"""Speculative decoding by prompt lookup through a ring (serving/scheduler.py proposes, the last stage verifies,
the first stage keeps what was accepted and rolls the rest back): the tokens are those of decoding one at a time,
on one stage and three, alone and together, with drafts kept and rejected. The fake engine's output mixes every
position's stored input (tests/fake_ring.py), so a rejected draft's keys and values left in place, or a position
skipped, would change every later token. And with a real model: the logits of a verification step's rows are
those of decoding the same tokens one by one, and the pool after a rejection holds what decoding the kept tokens
alone leaves."""

from __future__ import annotations

import asyncio
from dataclasses import replace

import numpy as np
import pytest

from exo_like.engines.choice import create_engine
from exo_like.engines.work import SampleSpec, SamplingParams, WorkItem
from exo_like.models.config import ModelArgs
from exo_like.models.shard import Shard
from exo_like.serving.scheduler import Scheduler, SchedulerLimits
from tests.checkpoints import make_checkpoint
from tests.engine_driver import Driver
from tests.fake_ring import VOCAB, generate, ring
from tests.native_kernels import NATIVE

# Prompts that repeat themselves, so that lookups find drafts; the fake model's continuations sometimes follow
# them and sometimes not.
PROMPTS = {f"r{i}": [(3 * i + j % (4 + i)) % VOCAB for j in range(20 + 3 * i)] for i in range(4)}
SPECULATING = SchedulerLimits(256, speculative_tokens=4)


COUNTS: dict[str, int] = {}  # the first stage's scheduler counts after the last run of `outputs`


async def outputs(n_stages: int, limits: SchedulerLimits, together: bool, max_tokens: int = 24, copying: int = 0):
    async with ring(n_stages, limits=limits) as net:
        net.first.engine.copying = copying  # (a one-stage ring: a model that repeats itself, mostly)
        if together:
            tasks = [generate(net.first, rid, prompt, max_tokens) for rid, prompt in PROMPTS.items()]
            results = await asyncio.wait_for(asyncio.gather(*tasks), 60)
        else:
            results = [await generate(net.first, rid, prompt, max_tokens) for rid, prompt in PROMPTS.items()]
        items = list(net.first.engine.items)
        COUNTS.update(net.first.stage.scheduler_counts())
    return dict(zip(PROMPTS, results)), items


def rejected_positions(items: list[WorkItem], plain: dict[str, list[int]]) -> int:
    """Positions computed beyond those decoding one at a time computes: rejected drafts'."""
    needed = sum(len(PROMPTS[rid]) + len(tokens) - 1 for rid, tokens in plain.items())
    return sum(item.count for item in items) - needed


@pytest.mark.parametrize("together", [False, True])
@pytest.mark.parametrize("n_stages", [1, 3])
async def test_speculation_gives_the_tokens_of_decoding_one_at_a_time(n_stages, together):
    """Drafts the fake model rejects (its tokens follow no pattern): verified, rolled back, the same tokens."""
    plain, _ = await outputs(n_stages, SchedulerLimits(256), together)
    speculated, items = await outputs(n_stages, SPECULATING, together)
    assert speculated == plain
    assert any(item.sample is not None and item.sample.draft for item in items), "no draft was proposed"
    assert rejected_positions(items, plain) > 0


@pytest.mark.parametrize("together", [False, True])
async def test_drafts_the_model_agrees_with_take_fewer_steps(together):
    plain, plain_items = await outputs(1, SchedulerLimits(256), together, copying=3)
    speculated, items = await outputs(1, SPECULATING, together, copying=3)
    assert speculated == plain
    sampled = sum(1 for item in items if item.sample is not None)
    assert sampled < 0.75 * sum(len(tokens) for tokens in plain.values())  # several tokens a verification
    assert rejected_positions(items, plain) > 0  # and every fifth position's draft rejected
    # what /metrics and /v1/cluster report: the proposed tokens and those kept
    proposed = sum(len(item.sample.draft) for item in items if item.sample is not None)
    kept = sum(len(tokens) for tokens in plain.values()) - sum(1 for item in items if item.sample is not None)
    verifications = sum(1 for item in items if item.sample is not None and item.sample.draft)
    assert (COUNTS["draft_tokens"], COUNTS["accepted_tokens"], COUNTS["drafts"]) == (proposed, kept, verifications)


def test_drafts_shrink_for_a_request_whose_proposals_are_rejected_and_stop():
    scheduler, _ = scheduled(SchedulerLimits(256, speculative_tokens=8), [1, 2, 3, 4, 5, 6, 7, 8] * 3)
    scheduler.on_sampled("r", [1], False)
    lengths = []
    for _ in range(10):
        item = scheduler.schedule().items[0]
        lengths.append(len(item.sample.draft))
        scheduler.on_sampled("r", [99], False)  # the target disagrees with the first proposed token, every time
        scheduler.running["r"].tokens[-1:] = []  # (the text goes back to its pattern: the lookup finds it again)
        scheduler.running["r"].tokens.append(1)
        scheduler.running["r"].computed = len(scheduler.running["r"].tokens) - 1
    # 1 kept in 2 to start (2 tokens), then 1 at most (and only for matches of 3 tokens or more), none once fewer
    # than 1 in 5 are kept
    assert lengths[0] == 2 and max(lengths[1:]) == 1 and lengths[-3:] == [0, 0, 0]


def test_the_counts_reach_metrics():
    from exo_like.cluster.node_load import NodeLoad
    from exo_like.serving.metrics import Metrics

    text = Metrics(lambda: NodeLoad(draft_tokens=12, accepted_tokens=7, drafts=4)).render().decode()
    assert "exo_like:spec_decode_num_draft_tokens_total 12.0" in text
    assert "exo_like:spec_decode_num_accepted_tokens_total 7.0" in text
    assert "exo_like:spec_decode_num_drafts_total 4.0" in text
    assert NodeLoad.from_json(NodeLoad(draft_tokens=12, accepted_tokens=7).to_json()).accepted_tokens == 7


def scheduled(limits: SchedulerLimits, tokens: list[int]) -> tuple[Scheduler, WorkItem]:
    scheduler = Scheduler(64, limits)
    spec = SampleSpec(SamplingParams(temperature=0.0), 50, (), len(tokens))
    scheduler.submit("r", "o", tokens, spec)
    step = scheduler.schedule()
    return scheduler, step.items[0]


def test_the_first_stage_keeps_what_was_verified_and_rolls_the_rest_back():
    prompt = [1, 2, 3, 4, 1, 2, 3]
    scheduler, _ = scheduled(SPECULATING, prompt)
    scheduler.on_sampled("r", [4], False)  # the prompt's token: ... 1 2 3 4; the lookup proposes 1 2 3 4
    item = scheduler.schedule().items[0]  # a new request's drafts start at 2 tokens (a kept rate of 1 in 2)
    assert item.sample.draft == (1, 2) and (item.start, item.count) == (7, 3)
    scheduler.on_sampled("r", [1, 9], False)  # one kept, then the target's 9
    seq = scheduler.running["r"]
    assert seq.tokens == prompt + [4, 1, 9] and seq.computed == 9 and seq.pending == 1
    item = scheduler.schedule().items[0]  # position 9 (the token 9) is next
    assert item.start == 9
    scheduler.on_sampled("r", [5], False)
    assert scheduler.running["r"].computed == len(scheduler.running["r"].tokens) - 1


def test_nothing_is_proposed_under_load_or_for_stateful_sampling():
    busy = SchedulerLimits(256, speculative_tokens=4, speculative_max_running=1)
    scheduler = Scheduler(64, busy)
    for rid in ("a", "b"):
        scheduler.submit(rid, "o", [1, 2, 1, 2, 1], SampleSpec(SamplingParams(temperature=0.0), 50, (), 5))
    scheduler.schedule()
    for rid in ("a", "b"):
        scheduler.on_sampled(rid, [2], False)
    assert all(not item.sample.draft for item in scheduler.schedule().items)
    penalized = SampleSpec(SamplingParams(temperature=0.0, repetition_penalty=1.3), 50, (), 5)
    scheduler = Scheduler(64, SPECULATING)
    scheduler.submit("p", "o", [1, 2, 1, 2, 1], penalized)
    scheduler.schedule()
    scheduler.on_sampled("p", [2], False)
    assert not scheduler.schedule().items[0].sample.draft


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    return make_checkpoint(tmp_path_factory.mktemp("speculative") / "llama", "llama", n_layers=2, seed=5)


@pytest.mark.parametrize("engine_name", ["torch", "mlx"])
def test_a_verification_steps_rows_are_the_logits_of_decoding_one_by_one(llama, engine_name):
    """One step of [last token, d1, d2, d3] sampling every row gives the logits of feeding them one at a time;
    after keeping d1 only (the rest rejected), decoding on from position 2 gives what it gives without the
    rejected positions ever computed."""
    if engine_name == "mlx":
        pytest.importorskip("mlx.core", reason="mlx is not installed (install the 'mlx' extra)")
    args = ModelArgs.from_dir(llama)
    engine = create_engine(engine_name, device="cpu", dtype="float32")
    engine.load(llama, args, Shard.whole(llama.name, args.num_hidden_layers))
    prompt, draft, spec = [3, 17, 29, 5, 11], (42, 7, 19), SampleSpec(SamplingParams(temperature=0.0), 50, (), 5)
    alone = Driver([engine])
    alone.forward("a", np.array(prompt[:-1]))
    expected = [alone.forward("a", np.array([t])) for t in [prompt[-1], *draft]]
    verifying = Driver([engine])
    verifying.forward("v", np.array(prompt[:-1]))
    table = verifying.tables["v"]
    # torch's CPU path on its native kernels is batch-invariant (a row's result the same in any step:
    # tests/engines/test_batch_invariance.py): bit for bit; elsewhere (MLX, torch without them) to float32 rounding
    exact = {"rtol": 0, "atol": 0} if engine_name == "torch" and NATIVE else {"rtol": 1e-5, "atol": 1e-5}
    rows = verifying.step([(WorkItem("v", "o", len(prompt) - 1, 4, tuple(table), replace(spec, draft=draft)),
                            np.array([prompt[-1], *draft]))])
    np.testing.assert_allclose(rows, np.stack(expected), **exact)
    # keep d1 and the target's next token; decode on from there, over the rejected positions' stale slots
    kept = [int(np.argmax(rows[1]))]
    after = verifying.step([(WorkItem("v", "o", len(prompt) + 1, 1, tuple(table), spec), np.array(kept))])[0]
    fresh = Driver([engine])
    fresh.forward("f", np.array([*prompt, draft[0]]))
    np.testing.assert_allclose(after, fresh.forward("f", np.array(kept)), **exact)


@pytest.mark.parametrize("lost, new_ring", [("n1", ["n0", "n3", "n2"]), ("n0", ["n3", "n1", "n2"])])
async def test_a_replay_under_speculation_costs_the_request_nothing(lost, new_ring):
    """The ring loses a stage mid-stream (the first stage, which proposes, too): the request replays on the new
    ring from the tokens its origin has, and its tokens are those of an uninterrupted run without speculation."""
    from tests.serving.test_replay import GREEDY, HANG_SECONDS, lose_then_replan, stream

    prompt = [1, 2, 3, 1, 2, 3, 1, 2, 3, 1, 2]
    async with ring(3, limits=SchedulerLimits(256)) as net:
        expected = await generate(net.first, "ref", prompt, 40, GREEDY)
    async with ring(3, spares=1, limits=SPECULATING) as net:
        origin = net.nodes["n2"]
        tokens = await asyncio.wait_for(stream(origin, "a", prompt, 40, action=lose_then_replan(net, lost, new_ring)),
                                        HANG_SECONDS)
        assert origin.origin.replays_total == 1
    assert tokens == expected
