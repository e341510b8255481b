"""Token sampling on the last stage's logits: logit bias, repetition / frequency / presence penalties, then greedy or
temperature, min-p, top-k and top-p, seeded; and the log-probabilities of the distribution the token came from.

Pure numpy so every engine samples identically and a seed reproduces across MLX and PyTorch nodes. The random
draw for a request's n-th generated token comes from (seed, n) alone, not from a stream the last stage keeps:
the token is the same whatever else shares the batch, and a request recomputed from its tokens (preempted, or
moved to another ring) continues exactly as it would have.

The order is vLLM's: a grammar's mask first (tokens it does not allow are out, as if their logits were -inf); the
bias is added to the logits; the repetition penalty divides a positive logit (multiplies a
negative one) of every token in the prompt or the output; the frequency penalty subtracts itself once per
occurrence of a token in the output, the presence penalty once if it occurs at all (OpenAI's definitions). Then the
logits are divided by the temperature, min-p drops tokens less likely than min_p times the likeliest, top-k keeps
the k likeliest of those, top-p the smallest set of them holding top_p of their mass. Log-probabilities are those
of the distribution the token is drawn from (after all of that, renormalized; a token cut off has none and is
reported at LOGPROB_FLOOR); a greedy request's are those of the adjusted logits at temperature 1, uncut.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass

import numpy as np

from exo_like.engines.work import SamplingParams

__all__ = ["SamplingParams", "TokenHistory", "Choice", "LOGPROB_FLOOR", "choose", "sample_nth", "adjust",
           "probabilities"]

# top-p looks at this many best tokens first; only if they hold less than top_p of the mass does it sort all.
_NUCLEUS_CANDIDATES = 512
# The log-probability reported for a token the distribution excludes (JSON has no -Infinity; vLLM reports the same).
LOGPROB_FLOOR = -9999.0


class TokenHistory:
    """A request's tokens as the penalties see them: the distinct tokens of its prompt, and how often each token
    occurs in its output so far."""

    def __init__(self, prompt: Iterable[int], generated: Iterable[int] = ()):
        self.prompt_ids = np.unique(np.fromiter(prompt, dtype=np.int64))
        self.counts: dict[int, int] = {}
        for token in generated:
            self.add(token)

    def add(self, token: int) -> None:
        self.counts[token] = self.counts.get(token, 0) + 1


@dataclass(frozen=True)
class Choice:
    """A sampled token; with its log-probability and the likeliest tokens' when they were asked for."""

    token: int
    logprob: float | None = None
    top_logprobs: tuple[tuple[int, float], ...] = ()


def sample_nth(logits: np.ndarray, params: SamplingParams, seed: int, index: int) -> int:
    """The request's token number `index` (0 = the first generated) from its logits."""
    return choose(logits, params, seed, index).token


def choose(logits: np.ndarray, params: SamplingParams, seed: int, index: int,
           history: TokenHistory | None = None, allowed: np.ndarray | None = None) -> Choice:
    """The request's token number `index` from its logits, its penalties reading `history`, among the tokens its
    grammar `allowed` (a bool per logit; None: all)."""
    adjusted = adjust(logits, params, history, allowed)
    candidates, scaled = (None, adjusted) if params.greedy else _scaled_candidates(adjusted, params, allowed)
    if candidates is None:  # greedy, or a temperature that overflows the logits (its limit is greedy)
        token = int(np.argmax(adjusted))
        if params.logprobs is None:
            return Choice(token)
        return _with_logprobs(token, np.arange(adjusted.size), adjusted, adjusted, params.logprobs)
    token = _draw(candidates, scaled, np.random.default_rng([seed, index]))
    return _with_logprobs(token, candidates, scaled, adjusted, params.logprobs)


def probabilities(logits: np.ndarray, params: SamplingParams) -> np.ndarray:
    """The distribution a sampled (not greedy) request's token is drawn from, over the whole vocabulary (float64,
    zero outside its candidates): what speculative sampling compares a draft's proposal with."""
    candidates, scaled = _scaled_candidates(adjust(logits, params, None), params, None)
    probs = np.zeros(logits.size, dtype=np.float64)
    if candidates is None:  # a temperature whose limit is greedy
        probs[int(np.argmax(scaled))] = 1.0
    else:
        probs[candidates] = _softmax(scaled)
    return probs


def adjust(logits: np.ndarray, params: SamplingParams, history: TokenHistory | None,
           allowed: np.ndarray | None = None) -> np.ndarray:
    """The logits after the grammar's mask (-inf where not allowed), the bias and the penalties (the row itself when
    none applies)."""
    penalize = params.penalized and history is not None
    if not params.logit_bias and not penalize and allowed is None:
        return logits
    out = logits.astype(np.float64)
    if allowed is not None:
        out[~allowed] = -np.inf
    if params.logit_bias:
        ids = np.fromiter((token for token, _ in params.logit_bias), dtype=np.int64)
        np.add.at(out, ids, np.fromiter((bias for _, bias in params.logit_bias), dtype=np.float64))
    if not penalize:
        return out
    generated = np.fromiter(history.counts, dtype=np.int64, count=len(history.counts))
    counts = np.fromiter(history.counts.values(), dtype=np.float64, count=len(history.counts))
    if params.repetition_penalty != 1.0:
        seen = np.union1d(history.prompt_ids, generated)
        values = out[seen]
        out[seen] = np.where(values > 0, values / params.repetition_penalty, values * params.repetition_penalty)
    if generated.size:
        out[generated] -= params.frequency_penalty * counts + params.presence_penalty
    return out


def _scaled_candidates(logits: np.ndarray, params: SamplingParams,
                       allowed: np.ndarray | None) -> tuple[np.ndarray | None, np.ndarray]:
    """The tokens the draw is among and their logits over the temperature (None when the temperature overflows)."""
    with np.errstate(over="ignore"):
        scaled_all = logits.astype(np.float64) / params.temperature
    top = scaled_all.max()
    if not np.isfinite(top):
        # A temperature so close to 0 (a valid one, e.g. 1e-310) that the logits overflow: softmax would be all
        # NaN and pick the last token; its limit is greedy.
        return None, scaled_all
    if params.min_p > 0.0:  # p_i >= min_p p_max  <=>  s_i >= s_max + log(min_p)
        candidates = np.flatnonzero(scaled_all >= top + math.log(params.min_p))
        scaled = scaled_all[candidates]
    elif allowed is not None:  # the grammar's tokens only (the others' -inf would never be drawn, but be exact)
        candidates = np.flatnonzero(allowed)
        scaled = scaled_all[candidates]
    else:
        candidates, scaled = np.arange(scaled_all.size), scaled_all
    candidates, scaled = _top_k(candidates, scaled, params.top_k)
    if params.top_p < 1.0:
        probs = _softmax(scaled)
        kept = _nucleus(probs, params.top_p)
        candidates, scaled = candidates[kept], scaled[kept]
    return candidates, scaled


def _draw(candidates: np.ndarray, scaled: np.ndarray, rng: np.random.Generator) -> int:
    probs = _softmax(scaled)
    choice = int(np.searchsorted(np.cumsum(probs), rng.random() * probs.sum(), side="right"))
    return int(candidates[min(choice, len(candidates) - 1)])


def _softmax(scaled: np.ndarray) -> np.ndarray:
    probs = np.exp(scaled - scaled.max())
    return probs / probs.sum()


def _top_k(candidates: np.ndarray, scaled: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
    """The k best of the candidates (all of them when k is 0 or >= their number)."""
    if k <= 0 or k >= scaled.size:
        return candidates, scaled
    idx = np.argpartition(-scaled, k - 1)[:k]
    return candidates[idx], scaled[idx]


def _nucleus(probs: np.ndarray, top_p: float) -> np.ndarray:
    """Indices of the smallest set of most likely tokens whose mass reaches top_p (ties broken by position)."""
    order = _descending(probs, top_p)
    cumulative = np.cumsum(probs[order])
    keep = int(np.searchsorted(cumulative, top_p, side="left")) + 1
    return order[: min(keep, order.size)]


def _descending(probs: np.ndarray, top_p: float) -> np.ndarray:
    """Order of probs, largest first. Sorting the best few is enough when they already hold top_p of the mass,
    because the nucleus is then among them; otherwise sort the whole vocabulary."""
    if probs.size > _NUCLEUS_CANDIDATES:
        head = np.argpartition(-probs, _NUCLEUS_CANDIDATES - 1)[:_NUCLEUS_CANDIDATES]
        head = head[np.lexsort((head, -probs[head]))]
        if probs[head].sum() >= top_p:
            return head
    return np.lexsort((np.arange(probs.size), -probs))


def _with_logprobs(token: int, candidates: np.ndarray, scaled: np.ndarray, adjusted: np.ndarray,
                   wanted: int | None) -> Choice:
    """`token` with its log-probability and the `wanted` likeliest tokens' under the distribution over
    `candidates` given by `scaled`; tokens outside it follow at LOGPROB_FLOOR, likeliest (by `adjusted`) first."""
    if wanted is None:
        return Choice(token)
    logprobs = scaled - scaled.max()
    logprobs -= np.log(np.exp(logprobs).sum())
    position = np.flatnonzero(candidates == token)
    chosen = float(logprobs[position[0]]) if position.size else LOGPROB_FLOOR
    if wanted <= 0:
        return Choice(token, chosen)
    best = np.arange(logprobs.size)
    if wanted < logprobs.size:  # the `wanted` likeliest without sorting the whole vocabulary; ties all kept
        threshold = np.partition(logprobs, logprobs.size - wanted)[logprobs.size - wanted]
        best = np.flatnonzero(logprobs >= threshold)
    best = best[np.lexsort((candidates[best], -logprobs[best]))][:wanted]  # ties: the lower id first, as argmax
    top = [(int(candidates[i]), max(float(logprobs[i]), LOGPROB_FLOOR)) for i in best]  # (-inf: masked out)
    if len(top) < wanted and candidates.size < adjusted.size:
        outside = np.ones(adjusted.size, dtype=bool)
        outside[candidates] = False
        rest = np.flatnonzero(outside)
        rest = rest[np.lexsort((rest, -adjusted[rest]))][: wanted - len(top)]
        top += [(int(t), LOGPROB_FLOOR) for t in rest]
    return Choice(token, chosen, tuple(top))
