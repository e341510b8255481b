"""Speculative decoding's parts that need no model: proposals by prompt lookup, and their verification.

Proposals (`propose_ngram`, vLLM's and llama.cpp's prompt lookup): the request's last n tokens are looked for
earlier in its own tokens, longest n first, the latest match winning, and the tokens that followed it are the
draft. Where the answer repeats its input (editing, summarising, code) whole runs are proposed right.

Verification (`verify`), on the last stage: the ring computed the request's last token and the k draft tokens in
one step, so it has the target's logits after each of them (k + 1 rows). Greedy: the target's own choice at each
row, kept while it equals the draft's; the first that differs is the target's token and ends the run; all k kept,
the last row gives one more. The tokens are exactly those of decoding one at a time. Sampled (Leviathan et al.;
Chen et al.): draft token d at row i is kept with probability min(1, p(d) / q(d)), p the target's distribution
there (after temperature, min-p, top-k, top-p), q the draft's (a prompt lookup's is all on d); at the first
rejection the token comes from the residual max(p - q, 0), renormalised; all kept, the last row is sampled as
usual. Each emitted token is distributed as the target's. The random draws come from (seed, the token's index,
what they decide), so a request recomputed from its tokens continues as it would have.

Requests whose sampling keeps state at the last stage (penalties, a grammar) or asks for log-probabilities are not
speculated on (`speculable`): their rows would each need the state the earlier ones leave."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from exo_like.engines.work import SamplingParams
from exo_like.serving.sampling import choose, probabilities

ACCEPT, RESIDUAL = 1, 2  # what a random draw decides (its generator's third seed word)


def speculable(params: SamplingParams) -> bool:
    """Whether a request's tokens may be proposed and verified several at a time."""
    return not params.needs_history and params.logprobs is None


def propose_ngram(tokens: Sequence[int], k: int, max_n: int = 4, min_n: int = 1) -> tuple[int, ...]:
    """Up to k tokens that followed the latest earlier occurrence of the request's last n tokens (n from max_n
    down to min_n); () when none occurs."""
    if k <= 0:
        return ()
    array = np.asarray(tokens, dtype=np.int64)
    length = array.size
    for n in range(min(max_n, length - 1), min_n - 1, -1):
        tail = array[length - n:]
        windows = np.lib.stride_tricks.sliding_window_view(array[:length - 1], n)  # starts 0 .. length - 1 - n
        matches = np.flatnonzero((windows == tail).all(axis=1))
        if matches.size:
            start = int(matches[-1]) + n  # the token after the latest match
            return tuple(int(t) for t in array[start:start + k])
    return ()


def verify(rows: np.ndarray, draft: Sequence[int], params: SamplingParams, seed: int, index: int,
           draft_probs: np.ndarray | None = None) -> list[int]:
    """The tokens the target keeps of a draft and the one after: rows [k + 1, vocab] the target's logits after
    the request's last token and after each draft token; `index` the first of them's generated index;
    draft_probs [k, vocab] the draft's distributions (None: a prompt lookup's, all on its token)."""
    tokens: list[int] = []
    for i, proposed in enumerate(draft):
        if params.greedy:
            token = choose(rows[i], params, seed, index + i).token
        else:
            token = _sampled(rows[i], proposed, params, seed, index + i,
                             None if draft_probs is None else draft_probs[i])
        tokens.append(token)
        if token != proposed:
            return tokens
    tokens.append(choose(rows[len(draft)], params, seed, index + len(draft)).token)
    return tokens


def _sampled(row: np.ndarray, proposed: int, params: SamplingParams, seed: int, index: int,
             draft: np.ndarray | None) -> int:
    """The token at one row: `proposed` if kept, else a draw from the residual."""
    target = probabilities(row, params)
    if draft is None:
        draft = np.zeros_like(target)
        draft[proposed] = 1.0
    kept = min(1.0, target[proposed] / draft[proposed]) if draft[proposed] > 0 else 0.0
    if np.random.default_rng([seed, index, ACCEPT]).random() < kept:
        return proposed
    residual = np.maximum(target - draft, 0.0)
    total = residual.sum()
    if total <= 0:  # p == q where it matters: any rejection is measure zero; the target's own draw
        residual, total = target, target.sum()
    point = np.random.default_rng([seed, index, RESIDUAL]).random() * total
    return int(min(np.searchsorted(np.cumsum(residual), point, side="right"), residual.size - 1))
