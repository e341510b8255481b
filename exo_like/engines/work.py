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
class SampleSpec:
    """How the last stage turns a request's logits into a token, and when the request is done."""

    temperature: float
    top_p: float
    top_k: int
    seed: int
    max_tokens: int
    eos: tuple[int, ...]
    prompt_len: int  # the request's own prompt: tokens past it are generated ones


@dataclass(frozen=True)
class WorkItem:
    """One request's rows in a batch: positions [start, start + count) of request `rid`, whose keys and values
    live in the KV blocks `blocks` (the request's whole block table). `sample` is set when the last row's
    logits pick the request's next token.

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
