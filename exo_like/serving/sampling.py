"""Token sampling on the last stage's logits: greedy, temperature, top-k, top-p, seeded.

Pure numpy so every engine samples identically and a seed reproduces across MLX and PyTorch nodes. The random
draw for a request's n-th generated token comes from (seed, n) alone, not from a stream the last stage keeps:
the token is the same whatever else shares the batch, and a request recomputed from its tokens (preempted, or
moved to another ring) continues exactly as it would have.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

# top-p looks at this many best tokens first; only if they hold less than top_p of the mass does it sort all.
_NUCLEUS_CANDIDATES = 512


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 = no top-k cut
    seed: int | None = None

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


def sample_nth(logits: np.ndarray, params: SamplingParams, seed: int, index: int) -> int:
    """The request's token number `index` (0 = the first generated) from its logits."""
    if params.greedy:
        return int(np.argmax(logits))
    return sample(logits, params, np.random.default_rng([seed, index]))


def sample(logits: np.ndarray, params: SamplingParams, rng: np.random.Generator) -> int:
    if params.greedy:
        return int(np.argmax(logits))
    with np.errstate(over="ignore"):
        scaled_all = logits.astype(np.float64) / params.temperature
    if not np.isfinite(scaled_all.max()):
        # A temperature so close to 0 (a valid one, e.g. 1e-310) that the logits overflow: softmax would be all
        # NaN and pick the last token; its limit is greedy.
        return int(np.argmax(logits))
    candidates, scaled = _top_k(scaled_all, params.top_k)
    probs = np.exp(scaled - scaled.max())
    probs /= probs.sum()
    if params.top_p < 1.0:
        candidates, probs = _top_p(candidates, probs, params.top_p)
    choice = int(np.searchsorted(np.cumsum(probs), rng.random() * probs.sum(), side="right"))
    return int(candidates[min(choice, len(candidates) - 1)])


def _top_k(scaled: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
    """Indices and scaled logits of the k best tokens (all tokens when k is 0 or >= vocab)."""
    if k <= 0 or k >= scaled.size:
        return np.arange(scaled.size), scaled
    idx = np.argpartition(-scaled, k - 1)[:k]
    return idx, scaled[idx]


def _top_p(candidates: np.ndarray, probs: np.ndarray, top_p: float) -> tuple[np.ndarray, np.ndarray]:
    """The smallest set of most likely tokens whose mass reaches top_p (ties broken by token id)."""
    order = _descending(probs, top_p)
    cumulative = np.cumsum(probs[order])
    keep = int(np.searchsorted(cumulative, top_p, side="left")) + 1
    kept = order[: min(keep, order.size)]
    return candidates[kept], probs[kept]


def _descending(probs: np.ndarray, top_p: float) -> np.ndarray:
    """Order of probs, largest first. Sorting the best few is enough when they already hold top_p of the mass,
    because the nucleus is then among them; otherwise sort the whole vocabulary."""
    if probs.size > _NUCLEUS_CANDIDATES:
        head = np.argpartition(-probs, _NUCLEUS_CANDIDATES - 1)[:_NUCLEUS_CANDIDATES]
        head = head[np.lexsort((head, -probs[head]))]
        if probs[head].sum() >= top_p:
            return head
    return np.lexsort((np.arange(probs.size), -probs))
