"""Logit bias, penalties, min-p and log-probabilities, against a reference written here in plain numpy over the
whole vocabulary from the definitions (sampling.py's docstring), on the same logits."""

from __future__ import annotations

import numpy as np
import pytest

from exo_like.serving.sampling import LOGPROB_FLOOR, SamplingParams, TokenHistory, adjust, choose


def reference(logits: np.ndarray, params: SamplingParams, prompt: list[int],
              generated: list[int]) -> tuple[np.ndarray, np.ndarray]:
    """Log-probabilities of the distribution a token is drawn from (-inf: cut off), and the logits after the bias
    and the penalties."""
    x = logits.astype(np.float64).copy()
    for token, bias in params.logit_bias:
        x[token] += bias
    for token in set(prompt) | set(generated):
        x[token] = x[token] / params.repetition_penalty if x[token] > 0 else x[token] * params.repetition_penalty
    for token in set(generated):
        x[token] -= params.frequency_penalty * generated.count(token) + params.presence_penalty
    if params.greedy:
        return x - np.log(np.exp(x - x.max()).sum()) - x.max(), x
    s = x / params.temperature
    p = np.exp(s - s.max())
    p /= p.sum()
    keep = p >= params.min_p * p.max()
    if params.top_k:
        order = sorted(np.flatnonzero(keep), key=lambda t: (-p[t], t))
        keep[:] = False
        keep[order[:params.top_k]] = True
    if params.top_p < 1.0:
        q = np.where(keep, p, 0.0) / p[keep].sum()
        order = sorted(np.flatnonzero(keep), key=lambda t: (-q[t], t))
        total, kept = 0.0, []
        for token in order:
            kept.append(token)
            total += q[token]
            if total >= params.top_p:
                break
        keep[:] = False
        keep[kept] = True
    out = np.full(x.size, -np.inf)
    kept_s = s[keep]
    out[keep] = kept_s - kept_s.max() - np.log(np.exp(kept_s - kept_s.max()).sum())
    return out, x


CASES = [
    SamplingParams(temperature=0.0, logprobs=5),
    SamplingParams(temperature=0.0, repetition_penalty=1.3, logit_bias=((7, 5.0), (3, -100.0)), logprobs=3),
    SamplingParams(temperature=0.8, presence_penalty=0.5, frequency_penalty=0.7, logprobs=5),
    SamplingParams(temperature=1.2, repetition_penalty=0.8, min_p=0.05, logprobs=4),
    SamplingParams(temperature=0.7, top_k=20, top_p=0.9, min_p=0.01, frequency_penalty=-0.5, logprobs=6),
    SamplingParams(temperature=1.0, top_k=3, logprobs=8),  # more wanted than the draw is among
    SamplingParams(temperature=1.0, presence_penalty=2.0, repetition_penalty=1.5, logit_bias=((1, 3.0),)),
]


@pytest.mark.parametrize("params", CASES, ids=range(len(CASES)))
@pytest.mark.parametrize("vocab", [50, 4096])
def test_token_and_logprobs_follow_the_reference(params: SamplingParams, vocab: int) -> None:
    rng = np.random.default_rng(vocab)
    prompt = [int(t) for t in rng.integers(0, vocab, 12)]
    generated = [int(t) for t in rng.integers(0, vocab, 9)] + [5, 5, 5]
    for index in range(20):
        logits = (rng.standard_normal(vocab) * 3).astype(np.float32)
        logits[5] = logits.max() + 1.0  # a repeated token the penalties must pull down
        expected, adjusted = reference(logits, params, prompt, generated)
        choice = choose(logits, params, 99, index, TokenHistory(prompt, generated))
        if params.greedy:
            assert choice.token == int(np.argmax(expected))
        assert np.isfinite(expected[choice.token])  # drawn from what the reference keeps
        if params.logprobs is None:
            assert choice.logprob is None and choice.top_logprobs == ()
            continue
        assert choice.logprob == pytest.approx(expected[choice.token], rel=1e-4, abs=1e-6)
        # the likeliest first; then the cut-off ones, by their adjusted logits
        order = sorted(range(vocab), key=lambda t: (-expected[t], -adjusted[t], t))[:params.logprobs]
        assert [t for t, _ in choice.top_logprobs] == order
        for token, logprob in choice.top_logprobs:
            if np.isfinite(expected[token]):
                assert logprob == pytest.approx(expected[token], rel=1e-4, abs=1e-6)
            else:
                assert logprob == LOGPROB_FLOOR


def test_draws_follow_the_penalized_distribution() -> None:
    """Frequencies of many seeded draws match the reference distribution's probabilities."""
    logits = np.log(np.array([0.4, 0.3, 0.2, 0.1]))
    params = SamplingParams(temperature=1.0, frequency_penalty=0.5, presence_penalty=0.2, repetition_penalty=1.2)
    history = TokenHistory([2], [0, 0, 1])
    expected = np.exp(reference(logits, params, [2], [0, 0, 1])[0])
    drawn = np.bincount([choose(logits, params, 7, i, history).token for i in range(6000)], minlength=4) / 6000
    np.testing.assert_allclose(drawn, expected, atol=0.025)


def test_without_history_the_penalties_change_nothing_and_the_row_is_not_copied() -> None:
    logits = np.random.default_rng(1).standard_normal(100).astype(np.float32)
    params = SamplingParams(temperature=0.0, presence_penalty=100.0)
    assert adjust(logits, params, None) is logits
    assert choose(logits, params, 0, 0).token == int(np.argmax(logits))
    history = TokenHistory([], [int(np.argmax(logits))])
    assert choose(logits, params, 0, 0, history).token == int(np.argsort(logits)[-2])


def test_a_history_counts_its_tokens() -> None:
    history = TokenHistory([4, 4, 9], [1, 2, 1])
    history.add(2)
    assert history.prompt_ids.tolist() == [4, 9] and history.counts == {1: 2, 2: 2}
