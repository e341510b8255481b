"""Where a batch's rows sit in the KV pool: the framework-free part of an engine step.

A batch is a list of work items (protocol.WorkItem); its rows are the items' rows in order. Each engine keeps,
per layer, keys and values in a pool of `n_blocks * BLOCK_SIZE` slots; position p of an item lives in slot
`blocks[p // BLOCK_SIZE] * BLOCK_SIZE + p % BLOCK_SIZE`. This module works out those slots once per step, so
every layer of every engine uses the same numbers.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from exo_like.engines.work import BLOCK_SIZE, WorkItem, blocks_for
from exo_like.errors import InvalidRequestError

_OFFSETS = np.arange(BLOCK_SIZE, dtype=np.int64)


@dataclass(frozen=True)
class ItemLayout:
    row_start: int
    row_end: int
    start: int  # first new position
    end: int  # positions attended to: [0, end)
    base: int | None  # slot of position 0 when positions [0, end) sit in consecutive slots (a view, no gather)
    slots: np.ndarray  # slots of positions [0, end) otherwise

    @property
    def count(self) -> int:
        return self.row_end - self.row_start


@dataclass(frozen=True)
class BatchLayout:
    items: tuple[ItemLayout, ...]
    positions: np.ndarray  # [rows] position of each row
    write_slots: np.ndarray  # [rows] slot each row's key and value go to
    sample_rows: np.ndarray  # rows whose logits the last stage samples, in item order

    @property
    def rows(self) -> int:
        return int(self.positions.shape[0])


def slots_of(blocks: Sequence[int], end: int) -> np.ndarray:
    table = np.asarray(blocks[:blocks_for(end)], dtype=np.int64)
    return (table[:, None] * BLOCK_SIZE + _OFFSETS).reshape(-1)[:end]


def layout(items: Sequence[WorkItem], n_blocks: int, context_length: int) -> BatchLayout:
    """The batch's slots; InvalidRequestError if an item points outside the pool or past the context."""
    if not items:
        raise InvalidRequestError("a batch needs at least one item")
    layouts, positions, writes, sample_rows = [], [], [], []
    row = 0
    for item in items:
        _check(item, n_blocks, context_length)
        slots = slots_of(item.blocks, item.end)
        table = item.blocks[:blocks_for(item.end)]
        consecutive = all(b == table[0] + i for i, b in enumerate(table))
        base = table[0] * BLOCK_SIZE if consecutive else None
        layouts.append(ItemLayout(row, row + item.count, item.start, item.end, base, slots))
        positions.append(np.arange(item.start, item.end, dtype=np.int64))
        writes.append(slots[item.start:])
        row += item.count
        if item.sample is not None:
            sample_rows.append(row - 1)
    return BatchLayout(tuple(layouts), np.concatenate(positions), np.concatenate(writes),
                       np.asarray(sample_rows, dtype=np.int64))


def _check(item: WorkItem, n_blocks: int, context_length: int) -> None:
    if item.start < 0 or item.count < 1:
        raise InvalidRequestError(f"request {item.rid}: positions [{item.start}, {item.end}) are not a new range")
    if item.end > context_length:
        raise InvalidRequestError(f"request needs {item.end} positions; the model's context is {context_length}",
                                  code="context_length_exceeded")
    needed = blocks_for(item.end)
    if len(item.blocks) < needed:
        raise InvalidRequestError(f"request {item.rid}: {len(item.blocks)} KV blocks cannot hold {item.end} positions")
    if any(not 0 <= b < n_blocks for b in item.blocks[:needed]):
        raise InvalidRequestError(f"request {item.rid}: a KV block id lies outside this node's pool of {n_blocks}")
