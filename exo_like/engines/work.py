"""What one engine step takes: work items (a request's rows and its KV block table, with how its last row is
sampled) and the block geometry of the KV pool every stage keeps.

Plain data: the peer protocol (cluster/protocol.py) carries these between stages and owns their wire form.
"""

from __future__ import annotations

from dataclasses import dataclass

BLOCK_SIZE = 16  # positions per KV block, the same on every node (the first stage's block tables assume it)


def blocks_for(positions: int) -> int:
    return -(-positions // BLOCK_SIZE)


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
    logits pick the request's next token."""

    rid: str
    origin: str
    start: int
    count: int
    blocks: tuple[int, ...]
    sample: SampleSpec | None = None

    @property
    def end(self) -> int:
        return self.start + self.count
