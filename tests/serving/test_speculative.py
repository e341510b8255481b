"""Speculative decoding's model-free parts (serving/speculative.py): prompt-lookup proposals, and verification that
keeps greedy tokens exactly and sampled tokens distributed as the target's (a statistical test that can fail)."""

from __future__ import annotations

import numpy as np
import pytest

from exo_like.engines.work import SamplingParams
from exo_like.serving.sampling import probabilities
from exo_like.serving.speculative import propose_ngram, speculable, verify

GREEDY = SamplingParams(temperature=0.0)
SAMPLED = SamplingParams(temperature=1.0)


def test_prompt_lookup_proposes_what_followed_the_latest_match_of_the_longest_tail():
    tokens = [5, 6, 7, 8, 1, 2, 5, 6, 7, 9, 3, 5, 6, 7]
    assert propose_ngram(tokens, 3) == (9, 3, 5)  # the tail 5 6 7 last occurred before 9 3 5
    assert propose_ngram(tokens, 1) == (9,)
    assert propose_ngram([1, 2, 3, 4], 3) == ()  # nothing repeats
    assert propose_ngram([4, 1, 2, 4], 2, max_n=1) == (1, 2)
    assert propose_ngram([7], 3) == () and propose_ngram([1, 1], 0) == ()
    assert propose_ngram([1, 2, 3, 1, 2], 5) == (3, 1, 2)  # up to the end of what is known


def test_requests_with_state_at_the_last_stage_are_not_speculated_on():
    assert speculable(GREEDY) and speculable(SAMPLED)
    assert not speculable(SamplingParams(temperature=0.0, repetition_penalty=1.2))
    assert not speculable(SamplingParams(temperature=0.0, logprobs=2))


def rows_choosing(choices: list[int], vocab: int = 16) -> np.ndarray:
    rows = np.zeros((len(choices), vocab), dtype=np.float32)
    rows[np.arange(len(choices)), choices] = 5.0
    return rows


def test_greedy_keeps_the_draft_while_the_target_agrees_then_takes_the_targets_token():
    rows = rows_choosing([4, 9, 2, 7])  # the target's choice after the last token and after each draft token
    assert verify(rows, [4, 9, 2], GREEDY, 0, 0) == [4, 9, 2, 7]  # all kept, and one more
    assert verify(rows, [4, 3, 2], GREEDY, 0, 0) == [4, 9]  # the second differs: the target's 9 ends it
    assert verify(rows, [1, 9, 2], GREEDY, 0, 0) == [4]
    assert verify(rows[:1], [], GREEDY, 0, 0) == [4]  # no draft: a plain decode step


TARGET = np.array([0.5, 0.3, 0.15, 0.05])
DRAFT = np.array([0.1, 0.2, 0.3, 0.4])


@pytest.mark.parametrize("draft_kind", ["draft model", "prompt lookup"])
def test_sampled_verification_keeps_the_targets_distribution(draft_kind):
    """The first token a verification emits, over 20,000 seeds, against the target's distribution: a chi-square
    test at p = 1e-6 (df 3: 30.7). The draft's proposal is drawn from q (a draft model) or is always token 3, the
    target's least likely (a prompt lookup); either way the emitted token must follow p."""
    logits = np.log(TARGET).astype(np.float32)
    assert np.allclose(probabilities(logits, SAMPLED), TARGET)
    rows = np.stack([logits, logits])
    rng = np.random.default_rng(7)
    trials, counts, kept = 20_000, np.zeros(4), 0
    for seed in range(trials):
        if draft_kind == "draft model":
            proposed = int(rng.choice(4, p=DRAFT))
            first = verify(rows, [proposed], SAMPLED, seed, 0, DRAFT[None, :])[0]
        else:
            proposed = 3
            first = verify(rows, [proposed], SAMPLED, seed, 0)[0]
        counts[first] += 1
        kept += first == proposed
    expected = TARGET * trials
    chi2 = float(((counts - expected) ** 2 / expected).sum())
    assert chi2 < 30.7, (counts, chi2)
    # and the draft is kept as often as theory says: sum_x min(p(x), q(x)), or p(3) for the lookup
    rate = np.minimum(TARGET, DRAFT).sum() if draft_kind == "draft model" else TARGET[3]
    assert abs(kept / trials - rate) < 5 * np.sqrt(rate * (1 - rate) / trials)


def test_a_kept_token_is_followed_by_the_next_rows_own_draw():
    """Sampled, a draft the target surely keeps (all its mass on it) passes on to the next row."""
    certain = np.full(4, -np.inf, dtype=np.float32)
    certain[2] = 0.0
    rows = np.stack([certain, certain, np.log(TARGET).astype(np.float32)])
    tokens = verify(rows, [2, 2], SAMPLED, 3, 0)
    assert tokens[:2] == [2, 2] and len(tokens) == 3
