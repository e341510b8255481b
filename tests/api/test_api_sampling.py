"""Sampling controls through the HTTP API, with the official `openai` client: penalties, logit bias and
log-probabilities of a node's answer equal a reference computed here in numpy from the same model's logits (the
engine run in-process on the same checkpoint, fed the node's tokens)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from exo_like.engines.torch.engine import TorchEngine
from exo_like.models.config import ModelArgs
from exo_like.models.shard import Shard
from exo_like.serving.sampling import LOGPROB_FLOOR, SamplingParams
from tests.api_server import NodeProcess, checkpoint, node  # noqa: F401  (fixtures)
from tests.engine_driver import Driver
from tests.serving.test_sampling_controls import reference

PROMPT = [3, 17, 29, 5, 11, 42, 7, 19, 23, 2, 31, 13, 5, 5]
TOKENS = 12


def engine_logits(model_dir: Path, tokens: list[int]) -> list[np.ndarray]:
    """The model's logits before each generated token of `tokens` (the prompt, then the node's answer)."""
    args = ModelArgs.from_dir(model_dir)
    engine = TorchEngine(device="cpu", dtype="float32")
    engine.load(model_dir, args, Shard.whole(model_dir.name, args.num_hidden_layers))
    driver = Driver([engine], n_blocks=16)
    rows = [driver.forward("r", np.array(PROMPT, dtype=np.int64))]
    for token in tokens[len(PROMPT):-1]:
        rows.append(driver.forward("r", np.array([token], dtype=np.int64)))
    return rows


def token_id(text: str) -> int:
    assert text.startswith("token_id:"), text
    return int(text[len("token_id:"):])


@pytest.mark.parametrize("params", [
    SamplingParams(temperature=0.0, presence_penalty=1.5, frequency_penalty=0.5, repetition_penalty=1.3,
                   logit_bias=((7, 4.0), (19, -100.0)), logprobs=4),
    SamplingParams(temperature=0.7, top_p=0.9, min_p=0.02, seed=11, frequency_penalty=1.0, logprobs=3),
], ids=["greedy-penalized", "sampled"])
def test_penalties_and_logprobs_follow_the_reference(node: NodeProcess, checkpoint: Path,  # noqa: F811
                                                     params: SamplingParams) -> None:
    import openai

    client = openai.OpenAI(base_url=node.base_url + "/v1", api_key="unused", max_retries=0, timeout=120)
    extra = {"ignore_eos": True, "return_tokens_as_token_ids": True, "repetition_penalty": params.repetition_penalty,
             "min_p": params.min_p}
    answer = client.completions.create(
        model=str(checkpoint), prompt=PROMPT, max_tokens=TOKENS, temperature=params.temperature, top_p=params.top_p,
        seed=params.seed, presence_penalty=params.presence_penalty, frequency_penalty=params.frequency_penalty,
        logit_bias={str(t): b for t, b in params.logit_bias}, logprobs=params.logprobs, extra_body=extra)
    logprobs = answer.choices[0].logprobs
    generated = [token_id(t) for t in logprobs.tokens]
    assert len(generated) == TOKENS
    for i, logits in enumerate(engine_logits(checkpoint, PROMPT + generated)):
        expected, adjusted = reference(logits, params, PROMPT, generated[:i])
        if params.greedy:
            assert generated[i] == int(np.argmax(expected)), i
        assert np.isfinite(expected[generated[i]]), i  # drawn from what the reference keeps
        assert logprobs.token_logprobs[i] == pytest.approx(expected[generated[i]], rel=1e-4, abs=1e-5), i
        top = {token_id(t): lp for t, lp in logprobs.top_logprobs[i].items()}
        # the likeliest first; then tokens the draw could not take (top-p, min-p), by their adjusted logits
        best = sorted(range(len(expected)), key=lambda t: (-expected[t], -adjusted[t], t))[:params.logprobs]
        assert set(top) == set(best), i
        for token, logprob in top.items():
            wanted = expected[token] if np.isfinite(expected[token]) else LOGPROB_FLOOR
            assert logprob == pytest.approx(wanted, rel=1e-4, abs=1e-5), i


def test_chat_logprobs_come_in_openais_shape_streamed_and_not(node: NodeProcess, checkpoint: Path) -> None:  # noqa: F811
    import openai

    client = openai.OpenAI(base_url=node.base_url + "/v1", api_key="unused", max_retries=0, timeout=120)
    request = dict(model=str(checkpoint), messages=[{"role": "user", "content": "Hi"}], max_tokens=8,
                   temperature=0, logprobs=True, top_logprobs=2, extra_body={"ignore_eos": True})
    whole = client.chat.completions.create(**request)
    content = whole.choices[0].logprobs.content
    assert len(content) == 8 and "".join(e.token for e in content) == whole.choices[0].message.content
    for entry in content:
        assert entry.logprob <= 0 and entry.bytes == list(entry.token.encode()) and len(entry.top_logprobs) == 2
        assert entry.top_logprobs[0].token == entry.token  # greedy: the chosen token is the likeliest
    streamed = [e for chunk in client.chat.completions.create(**request, stream=True)
                if chunk.choices and chunk.choices[0].logprobs for e in chunk.choices[0].logprobs.content]
    assert [(e.token, round(e.logprob, 5)) for e in streamed] == [(e.token, round(e.logprob, 5)) for e in content]
    plain = client.chat.completions.create(**{**request, "logprobs": False, "top_logprobs": None})
    assert plain.choices[0].logprobs is None


def metric(node: NodeProcess, name: str) -> float:  # noqa: F811
    from prometheus_client.parser import text_string_to_metric_families

    text = node.request("GET", "/metrics")[2].decode()
    return sum(s.value for f in text_string_to_metric_families(text) for s in f.samples if s.name == name)


def test_n_choices_reuse_the_prompts_keys_and_values(node: NodeProcess, checkpoint: Path) -> None:  # noqa: F811
    """n=4: four choices, seeded one after another (seed + i), the prompt computed once: the other three find its
    full blocks in the prefix cache."""
    import openai

    client = openai.OpenAI(base_url=node.base_url + "/v1", api_key="unused", max_retries=0, timeout=120)
    prompt = list(range(3, 43))  # 40 tokens: two full blocks of 16
    hits = metric(node, "exo_like:prefix_cache_hits_total")
    request = dict(model=str(checkpoint), prompt=prompt, max_tokens=6, temperature=1.0, seed=3,
                   extra_body={"ignore_eos": True})
    answer = client.completions.create(n=4, **request)
    assert [c.index for c in answer.choices] == [0, 1, 2, 3]
    assert answer.usage.prompt_tokens == 40 and answer.usage.completion_tokens == 24
    assert metric(node, "exo_like:prefix_cache_hits_total") - hits >= 3 * 32
    texts = [c.text for c in answer.choices]
    assert len(set(texts)) > 1  # each choice its own seed
    for i, text in enumerate(texts):  # choice i samples as a request with seed 3 + i alone
        alone = client.completions.create(**{**request, "seed": 3 + i})
        assert alone.choices[0].text == text
    streamed: dict[int, str] = {}
    finished = set()
    for chunk in client.completions.create(n=4, stream=True, **request):
        for choice in chunk.choices:
            streamed[choice.index] = streamed.get(choice.index, "") + choice.text
            if choice.finish_reason:
                finished.add(choice.index)
    assert finished == {0, 1, 2, 3} and [streamed[i] for i in range(4)] == texts
