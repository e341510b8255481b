"""What one engine step takes: work items (a request's rows and its KV block table, with how its last row is
sampled) and the block geometry of the KV pool every stage keeps.

Plain data: the peer protocol (cluster/protocol.py) carries these between stages and owns their wire form.
"""

from __future__ import annotations

from dataclasses import dataclass

BLOCK_SIZE = 16  # positions per KV block, the same on every node (the first stage's block tables assume it)


def blocks_for(positions: int) -> int:
    return -(-positions // BLOCK_SIZE)


def window_start(position: int, window: int) -> int:
    """The first position a query at `position` sees through a sliding window of `window` positions."""
    return max(0, position - window + 1)


@dataclass(frozen=True)
class KVPoolSize:
    """A stage's KV pool in blocks: `blocks` for the layers that attend to every position, `window_blocks` for
    the sliding-window layers (None: the stage holds none)."""

    blocks: int
    window_blocks: int | None = None


@dataclass(frozen=True)
class SamplingParams:
    """How a request's tokens are chosen from the logits (serving/sampling.py applies them, in vLLM's order)."""

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 = no top-k cut
    seed: int | None = None
    min_p: float = 0.0  # 0 = no min-p cut
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0  # 1 = none
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, bias) pairs
    logprobs: int | None = None  # None: no log-probabilities; n: the chosen token's and the n likeliest
    grammar: str | None = None  # an llguidance grammar the output must match (structured output, forced tool calls)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def penalized(self) -> bool:
        """Whether a request's earlier tokens change its logits (the last stage keeps its token history)."""
        return self.presence_penalty != 0.0 or self.frequency_penalty != 0.0 or self.repetition_penalty != 1.0

    @property
    def needs_history(self) -> bool:
        """Whether the last stage keeps state built from the request's tokens: the penalties count them, a grammar
        is advanced through the generated ones."""
        return self.penalized or self.grammar is not None


@dataclass(frozen=True)
class SampleSpec:
    """How the last stage turns a request's logits into a token, and when the request is done. `history`: every
    token of the request so far (prompt, then generated), sent with the first token the last stage samples for it
    when its state needs it (params.needs_history); the last stage then adds each token it samples itself. The
    grammar travels only with the history: later specs carry params without it (the last stage keeps its matcher)."""

    params: SamplingParams  # its seed set (one is drawn for a request without): token n comes from (seed, n)
    max_tokens: int
    eos: tuple[int, ...]
    prompt_len: int  # the request's own prompt: tokens past it are generated ones
    history: tuple[int, ...] | None = None
    cached: int = 0  # prompt tokens the first stage took from its prefix cache (the last stage reports them)
    # Tokens proposed for the item's last len(draft) positions (speculative decoding): each of its last
    # len(draft) + 1 rows is sampled, and the last stage keeps the draft as far as the target agrees
    # (serving/speculative.py). (): one token sampled from the last row.
    draft: tuple[int, ...] = ()

    @property
    def sampled_rows(self) -> int:
        """Rows of the item whose logits the last stage reads."""
        return len(self.draft) + 1


@dataclass(frozen=True)
class WorkItem:
    """One request's rows in a batch: positions [start, start + count) of request `rid`, whose keys and values
    live in the KV blocks `blocks` (the request's whole block table). `sample` is set when the last row's
    logits pick the request's next token (its last rows', verifying a draft: SampleSpec.draft).

    Sliding-window layers keep their keys and values in a pool of their own, and only the blocks their window
    still reaches: `window_blocks[j]` holds the request's block `window_first + j` there. None: they use the
    same ids as `blocks` (both pools the same size, as in the speed probe and engine-level tests)."""

    rid: str
    origin: str
    start: int
    count: int
    blocks: tuple[int, ...]
    sample: SampleSpec | None = None
    window_blocks: tuple[int, ...] | None = None
    window_first: int = 0

    @property
    def window_table(self) -> tuple[int, tuple[int, ...]]:
        """(first block index, block ids from it on) of the sliding-window layers' table."""
        return (0, self.blocks) if self.window_blocks is None else (self.window_first, self.window_blocks)

    @property
    def end(self) -> int:
        return self.start + self.count
