"""Constrained decoding: the sampler draws only what the grammar allows (log-probabilities over that distribution,
checked against numpy), and on a ring the last stage's matcher follows a request alone, batched with others,
preempted and replayed on a new ring (rebuilt from the request's tokens each time) to the same valid JSON."""

from __future__ import annotations

import asyncio
import contextlib
import json

import jsonschema
import numpy as np
import pytest

from exo_like.cluster.protocol import Forward
from exo_like.models.demo import EOT, build_tokenizer
from exo_like.serving.grammar import GrammarError, GrammarVocabulary, json_schema_grammar
from exo_like.serving.sampling import Choice, SamplingParams, TokenHistory, choose
from exo_like.serving.scheduler import SchedulerLimits
from tests.fake_ring import FakeNode, ring

TOKENIZER = build_tokenizer()
VOCAB = TOKENIZER.get_vocab_size()
LOGITS = VOCAB + 6  # as real checkpoints: the head has padding rows past the tokenizer's tokens
EOS = TOKENIZER.token_to_id(EOT)
SCHEMA = {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 6},
    "tags": {"type": "array", "items": {"enum": ["red", "green", "blue"]}, "maxItems": 3},
    "count": {"type": "integer", "minimum": -5, "maximum": 120}},
    "required": ["name", "tags", "count"], "additionalProperties": False}
PROMPT = [5, 17, 3, 88, 41, 9, 60, 5, 5]
MAX_TOKENS = 120


@pytest.fixture(scope="module")
def vocabulary() -> GrammarVocabulary:
    return GrammarVocabulary(TOKENIZER.to_str(), VOCAB, LOGITS, (EOS,))


def reference_logprobs(logits: np.ndarray, allowed: np.ndarray, temperature: float) -> np.ndarray:
    scaled = np.where(allowed, logits.astype(np.float64) / temperature, -np.inf)
    return scaled - np.log(np.exp(scaled - scaled.max()).sum()) - scaled.max()


def test_the_sampler_draws_only_allowed_tokens_with_their_log_probabilities() -> None:
    rng = np.random.default_rng(3)
    for trial in range(40):
        logits = rng.normal(0, 3, LOGITS).astype(np.float32)
        allowed = rng.random(LOGITS) < 0.05
        allowed[rng.integers(LOGITS)] = True
        temperature = (0.0, 0.7, 1.0)[trial % 3]
        params = SamplingParams(temperature=temperature, logprobs=3, seed=trial)
        choice = choose(logits, params, trial, 0, None, allowed)
        assert allowed[choice.token]
        expected = reference_logprobs(logits, allowed, temperature or 1.0)
        assert choice.logprob == pytest.approx(expected[choice.token], abs=1e-4)
        best = sorted(np.flatnonzero(allowed), key=lambda t: (-expected[t], t))[:3]
        assert [t for t, _ in choice.top_logprobs] == best[:len(choice.top_logprobs)]
        if temperature == 0.0:
            assert choice.token == best[0]


def test_penalties_apply_within_the_grammars_tokens() -> None:
    logits = np.zeros(LOGITS, dtype=np.float32)
    logits[[10, 11, 12]] = [5.0, 4.0, 1.0]
    allowed = np.zeros(LOGITS, dtype=bool)
    allowed[[11, 12]] = True
    history = TokenHistory([1, 2], [11, 11, 11])
    params = SamplingParams(temperature=0.0, frequency_penalty=1.5)  # 11: 4 - 4.5 < 12's 1
    assert choose(logits, params, 0, 3, history, allowed).token == 12
    assert choose(logits, SamplingParams(temperature=0.0), 0, 3, history, allowed).token == 11


def test_a_grammar_walk_with_random_logits_ends_in_valid_json(vocabulary: GrammarVocabulary) -> None:
    constraint = vocabulary.constraint(json_schema_grammar(SCHEMA))
    rng = np.random.default_rng(0)
    tokens: list[int] = []
    for index in range(MAX_TOKENS):
        choice = choose(rng.normal(0, 2, LOGITS).astype(np.float32), SamplingParams(seed=1), 1, index, None,
                        constraint.allowed())
        if choice.token == EOS:
            break
        assert choice.token < VOCAB  # never a padding row
        tokens.append(choice.token)
        constraint.advance(choice.token)
    else:
        pytest.fail("the grammar never ended")
    jsonschema.validate(json.loads(TOKENIZER.decode(tokens)), SCHEMA)


def test_schemas_the_engine_cannot_enforce_are_named(vocabulary: GrammarVocabulary) -> None:
    for schema, words in (({"type": "object", "properties": {"a": {"type": "nope"}}}, "nope"),
                          ({"type": "string", "pattern": "(("}, "unclosed"),
                          ({"$ref": "#/missing"}, "missing"),
                          ({"type": "object", "required": ["x"], "additionalProperties": False}, "unsatisfiable")):
        with pytest.raises(GrammarError, match=f"(?i){words}"):
            vocabulary.check(json_schema_grammar(schema))


async def constrained(origin: FakeNode, rid: str, sampling: SamplingParams, action_at: int = -1,
                      action=None) -> list[Choice]:  # noqa: ANN001
    got: list[Choice] = []
    async with contextlib.aclosing(origin.origin.generate(rid, PROMPT, sampling, MAX_TOKENS, (EOS,))) as stream:
        async for choice in stream:
            got.append(choice)
            if len(got) == action_at and action is not None:
                action()
    return got


def text_of(choices: list[Choice]) -> str:
    assert choices[-1].token == EOS, "the grammar did not end the request"
    return TOKENIZER.decode([c.token for c in choices[:-1]])


async def test_a_constrained_request_on_a_ring_is_the_same_alone_batched_preempted_and_replayed(
        vocabulary: GrammarVocabulary) -> None:
    sampling = SamplingParams(temperature=1.0, seed=11, presence_penalty=0.5, logprobs=1,
                              grammar=json_schema_grammar(SCHEMA))
    settings = dict(vocab=LOGITS, grammar=vocabulary)
    async with ring(3, **settings) as net:
        expected = await constrained(net.first, "a", sampling)
        carried = [item.sample for message in net.sent if isinstance(message, Forward) for item in message.items
                   if item.sample is not None and item.sample.params.grammar is not None]
        assert len(carried) == 2 and all(spec.history is not None for spec in carried)  # once, over both hops
    jsonschema.validate(json.loads(text_of(expected)), SCHEMA)

    small = {"type": "object", "properties": {"k": {"enum": [1, 2, 3]}}, "required": ["k"],
             "additionalProperties": False}
    others = {f"other{i}": SamplingParams(temperature=1.0, seed=i, grammar=json_schema_grammar(small))
              if i % 2 else SamplingParams(temperature=0.0) for i in range(4)}
    async with ring(3, kv_blocks=8, limits=SchedulerLimits(256, prefix_cache=False), **settings) as net:
        together = await asyncio.wait_for(asyncio.gather(
            constrained(net.first, "a", sampling),
            *(constrained(net.first, rid, params) for rid, params in others.items())), 60)
        assert together[0] == expected
        assert net.first.stage.scheduler.preemptions > 0
        for rid, got in zip(others, together[1:]):
            if others[rid].grammar is not None:
                jsonschema.validate(json.loads(text_of(got)), small)
        await asyncio.sleep(0.05)
        assert not any(node.stage.sampler_states for node in net.nodes.values())

    async with ring(3, spares=1, **settings) as net:
        def lose() -> None:
            net.lose("n1")
            asyncio.get_running_loop().call_later(0.05, net.replan, ["n0", "n3", "n2"])
        replayed = await asyncio.wait_for(constrained(net.nodes["n0"], "a", sampling, 5, lose), 30)
        assert replayed == expected
