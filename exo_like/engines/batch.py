"""Where a batch's rows sit in the KV pool: the framework-free part of an engine step.

A batch is a list of work items (protocol.WorkItem); its rows are the items' rows in order. Each engine keeps,
per layer, keys and values in a pool of `n_blocks * BLOCK_SIZE` slots; position p of an item lives in slot
`blocks[p // BLOCK_SIZE] * BLOCK_SIZE + p % BLOCK_SIZE`. Sliding-window layers have a pool of their own, where
an item's table holds only the blocks its window still reaches (WorkItem.window_table). This module works out
those slots once per step, so every layer of every engine uses the same numbers.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from exo_like.engines.work import BLOCK_SIZE, WorkItem, blocks_for, window_start
from exo_like.errors import InvalidRequestError

_OFFSETS = np.arange(BLOCK_SIZE, dtype=np.int64)


@dataclass(frozen=True)
class ItemLayout:
    row_start: int
    row_end: int
    start: int  # first new position
    end: int  # positions attended to: [0, end)
    base: int | None  # slot of position `origin` when positions [origin, end) sit in consecutive slots (a view)
    slots: np.ndarray  # slots of positions [origin, end) otherwise
    origin: int = 0  # the first position the table holds (sliding-window layers: the oldest block kept)

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


def slots_of(blocks: Sequence[int], end: int, first_block: int = 0) -> np.ndarray:
    """Slots of positions [first_block * BLOCK_SIZE, end), `blocks` holding the blocks from `first_block` on."""
    table = np.asarray(blocks[:blocks_for(end) - first_block], dtype=np.int64)
    return (table[:, None] * BLOCK_SIZE + _OFFSETS).reshape(-1)[:end - first_block * BLOCK_SIZE]


def layout(items: Sequence[WorkItem], n_blocks: int, context_length: int, window: int | None = None) -> BatchLayout:
    """The batch's slots in the pool of the layers attending to every position (`window` None), or in the
    sliding-window layers' pool; InvalidRequestError if an item points outside the pool or past the context."""
    if not items:
        raise InvalidRequestError("a batch needs at least one item")
    layouts, positions, writes, sample_rows = [], [], [], []
    row = 0
    for item in items:
        first_block, table = (0, item.blocks) if window is None else item.window_table
        _check(item, first_block, table, n_blocks, context_length, window)
        origin = first_block * BLOCK_SIZE
        slots = slots_of(table, item.end, first_block)
        table = table[:blocks_for(item.end) - first_block]
        consecutive = all(b == table[0] + i for i, b in enumerate(table))
        base = table[0] * BLOCK_SIZE if consecutive else None
        layouts.append(ItemLayout(row, row + item.count, item.start, item.end, base, slots, origin))
        positions.append(np.arange(item.start, item.end, dtype=np.int64))
        writes.append(slots[item.start - origin:])
        row += item.count
        if item.sample is not None:  # the last row's logits, or a draft's rows' (SampleSpec.draft)
            sample_rows.extend(range(row - item.sample.sampled_rows, row))
    return BatchLayout(tuple(layouts), np.concatenate(positions), np.concatenate(writes),
                       np.asarray(sample_rows, dtype=np.int64))


def _check(item: WorkItem, first_block: int, table: Sequence[int], n_blocks: int, context_length: int,
           window: int | None) -> None:
    if item.start < 0 or item.count < 1:
        raise InvalidRequestError(f"request {item.rid}: positions [{item.start}, {item.end}) are not a new range")
    if item.end > context_length:
        raise InvalidRequestError(f"request needs {item.end} positions; the model's context is {context_length}",
                                  code="context_length_exceeded")
    if window is not None and window_start(item.start, window) < first_block * BLOCK_SIZE:
        raise InvalidRequestError(f"request {item.rid}: its sliding-window table starts at block {first_block}, "
                                  f"after position {window_start(item.start, window)} its window still sees")
    needed = blocks_for(item.end) - first_block
    if len(table) < needed:
        raise InvalidRequestError(f"request {item.rid}: {len(table)} KV blocks cannot hold {item.end} positions")
    if any(not 0 <= b < n_blocks for b in table[:needed]):
        raise InvalidRequestError(f"request {item.rid}: a KV block id lies outside this node's pool of {n_blocks}")
