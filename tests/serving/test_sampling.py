"""Sampling: greedy, temperature, top-k, top-p and seeds, checked against the distributions they define."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from exo_like.serving.sampling import SamplingParams, sample_nth


def draw_many(logits: np.ndarray, params: SamplingParams, n: int = 4000) -> np.ndarray:
    """The first n tokens of one request seeded 1234 (token i drawn from (seed, i))."""
    return np.array([sample_nth(logits, params, 1234, i) for i in range(n)])


def test_greedy_is_argmax_and_ignores_seed() -> None:
    logits = np.array([0.1, 3.0, 2.9, -1.0], dtype=np.float32)
    for seed in (0, 7, 2**63 - 1):
        assert sample_nth(logits, SamplingParams(temperature=0.0), seed, 3) == 1


@pytest.mark.parametrize("temperature", [5e-324, 1e-310, 1e-300])
def test_a_temperature_whose_scaling_overflows_is_greedy(temperature: float) -> None:
    """Found by tests/api/test_fuzz_api.py: logits / 1e-310 overflow to inf, and softmax of that is NaN."""
    logits = np.array([-3.0, 7.5, 2.0, -8.0], dtype=np.float32)
    with np.errstate(over="raise", invalid="raise", divide="raise"):  # no RuntimeWarning in the node's log
        assert sample_nth(logits, SamplingParams(temperature=temperature), 1, 0) == 1
        assert sample_nth(logits, SamplingParams(temperature=temperature, top_k=2, top_p=0.5), 1, 0) == 1


def test_a_token_depends_on_its_seed_and_index_only() -> None:
    logits = np.random.default_rng(0).standard_normal(1000).astype(np.float32)
    params = SamplingParams(temperature=1.0)
    run_a = [sample_nth(logits, params, 42, i) for i in range(50)]
    # In any order, and whatever was drawn before (no stream is kept between tokens).
    run_b = [sample_nth(logits, params, 42, i) for i in reversed(range(50))][::-1]
    assert run_a == run_b
    assert len(set(run_a)) > 10  # the index moves the draw
    assert [sample_nth(logits, params, 43, i) for i in range(50)] != run_a


def test_temperature_one_matches_softmax_frequencies() -> None:
    logits = np.log(np.array([0.5, 0.3, 0.2]))
    counts = np.bincount(draw_many(logits, SamplingParams(temperature=1.0)), minlength=3) / 4000
    np.testing.assert_allclose(counts, [0.5, 0.3, 0.2], atol=0.03)


def test_low_temperature_sharpens() -> None:
    logits = np.log(np.array([0.5, 0.3, 0.2]))
    counts = np.bincount(draw_many(logits, SamplingParams(temperature=0.25)), minlength=3) / 4000
    expected = np.array([0.5, 0.3, 0.2]) ** 4
    np.testing.assert_allclose(counts, expected / expected.sum(), atol=0.03)


def test_top_k_only_draws_from_the_k_best() -> None:
    logits = np.array([1.0, 5.0, 2.0, 4.0, 3.0])
    drawn = set(draw_many(logits, SamplingParams(temperature=5.0, top_k=2), n=500).tolist())
    assert drawn == {1, 3}


def test_top_p_keeps_smallest_set_reaching_mass() -> None:
    probs = np.array([0.05, 0.4, 0.25, 0.2, 0.1])
    drawn = set(draw_many(np.log(probs), SamplingParams(temperature=1.0, top_p=0.8), n=2000).tolist())
    assert drawn == {1, 2, 3}  # 0.4 + 0.25 < 0.8 <= 0.4 + 0.25 + 0.2


def test_top_p_on_large_vocab_uses_whole_distribution_when_flat() -> None:
    # A flat distribution over 5000 tokens: the nucleus is larger than the partial-sort head.
    logits = np.zeros(5000)
    drawn = draw_many(logits, SamplingParams(temperature=1.0, top_p=0.5), n=3000)
    assert drawn.max() < 2500 + 1  # ties broken by token id: nucleus is the first half
    assert len(set(drawn.tolist())) > 1000


@settings(max_examples=60, deadline=None)
@given(
    logits=st.lists(st.floats(-20, 20), min_size=1, max_size=800),
    temperature=st.floats(0.05, 2.0),
    top_p=st.floats(0.01, 1.0),
    top_k=st.integers(0, 50),
    seed=st.integers(0, 2**31),
)
def test_sample_returns_a_token_allowed_by_top_k(logits, temperature, top_p, top_k, seed) -> None:
    array = np.array(logits, dtype=np.float32)
    token = sample_nth(array, SamplingParams(temperature, top_p, top_k, seed), seed, 0)
    assert 0 <= token < array.size
    if 0 < top_k < array.size:
        assert array[token] >= np.sort(array)[-top_k]


@pytest.mark.parametrize("vocab", [10, 151936])
def test_greedy_large_vocab(vocab: int) -> None:
    logits = np.zeros(vocab, dtype=np.float32)
    logits[vocab // 3] = 1.0
    assert sample_nth(logits, SamplingParams(temperature=0.0), 0, 0) == vocab // 3
