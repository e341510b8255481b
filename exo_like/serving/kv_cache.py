"""The first stage's KV cache manager: which blocks of the ring's two KV pools each request holds (vLLM's
KVCacheManager, for this ring's pools; kv_blocks.py has the pools themselves).

For every request it keeps a `RequestBlocks`: its blocks in the pool of the layers that attend to every position,
and in the sliding-window layers' pool the blocks its window still reaches. The scheduler asks it for blocks
(`allocate`), gives back what a window no longer reaches (`slide`), what a request is done with (`free`), and what a
step computed but did not keep (`rollback`: speculative decoding's rejected positions); prompts start from the
longest cached prefix both pools can serve (`take_prefix`), and full blocks of known tokens are registered for later
prompts (`register_full_blocks`). The scheduler keeps ordering, budgets and preemption, and asks nothing else of
the pools.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from exo_like.engines.work import BLOCK_SIZE, blocks_for, window_start
from exo_like.serving.kv_blocks import ROOT_HASH, BlockPool, block_hash


@dataclass(eq=False)
class RequestBlocks:
    """One request's blocks: `blocks` hold its positions from 0 on in the first pool; `window_blocks` hold its
    positions from block `window_first` on in the sliding-window layers' pool."""

    blocks: list[int] = field(default_factory=list)
    window_blocks: list[int] = field(default_factory=list)
    window_first: int = 0
    registered: int = 0  # leading blocks registered in the prefix cache
    parent_hash: bytes = ROOT_HASH  # hash of the last registered block


class KVCache:
    """Both pools of the ring's KV cache and the blocks each request holds in them."""

    def __init__(self, n_blocks: int, window: int | None = None, n_window_blocks: int | None = None):
        self.pool = BlockPool(n_blocks)
        # The sliding-window layers' pool (if the model has such layers): a request holds the blocks its window
        # reaches, from window_start(next position) on (see kv_blocks.py).
        self.window = window if n_window_blocks is not None else None
        self.window_pool = BlockPool(n_window_blocks) if self.window is not None else None

    @property
    def capacity(self) -> int:
        """Positions one request can hold at most (the first pool's)."""
        return self.pool.n_blocks * BLOCK_SIZE

    def table(self, held: RequestBlocks) -> tuple[tuple[int, ...], tuple[int, ...] | None, int]:
        """A WorkItem's block tables for `held`: (blocks, window blocks or None without a window pool, first)."""
        if self.window is None:
            return tuple(held.blocks), None, 0
        return tuple(held.blocks), tuple(held.window_blocks), held.window_first

    # -- allocation ---------------------------------------------------------------------------------------

    def allocate(self, held: RequestBlocks, end: int, window_end: int) -> bool:
        """Blocks so that `held` reaches position `end` in the first pool and `window_end` in the window pool
        (runs continued after its last block where the pools allow); both or neither (False: not enough room)."""
        needed = blocks_for(end) - len(held.blocks)
        new = self.pool.allocate(needed, held.blocks[-1] if held.blocks else None) if needed > 0 else []
        if new is None:
            return False
        window_needed = self._window_needed(held, window_end)
        if window_needed > 0:
            last = held.window_blocks[-1] if held.window_blocks else None
            window_new = self.window_pool.allocate(window_needed, last)
            if window_new is None:
                self.pool.release(new)
                return False
            held.window_blocks += window_new
        held.blocks += new
        return True

    def held_positions(self, held: RequestBlocks) -> int:
        """Positions `held` reaches (in both pools)."""
        positions = len(held.blocks) * BLOCK_SIZE
        if self.window is None:
            return positions
        return min(positions, (held.window_first + len(held.window_blocks)) * BLOCK_SIZE)

    def _window_needed(self, held: RequestBlocks, end: int) -> int:
        """More sliding-window blocks for `held` to reach position `end`."""
        if self.window is None:
            return 0
        return blocks_for(end) - held.window_first - len(held.window_blocks)

    def slide(self, held: RequestBlocks, next_position: int) -> None:
        """Give back the sliding-window blocks the window of `next_position` no longer reaches. A block released here
        may be written for another request by the next step: every stage runs steps in order, so this request's
        steps before that have read it on every stage by then."""
        if self.window is None:
            return
        first = window_start(next_position, self.window) // BLOCK_SIZE
        gone = min(first - held.window_first, len(held.window_blocks))
        if gone > 0:
            self.window_pool.release(held.window_blocks[:gone])
            del held.window_blocks[:gone]
            held.window_first += gone

    def free(self, held: RequestBlocks) -> None:
        """`held`'s blocks go back (registered ones stay cached), and it starts again from nothing."""
        self.pool.release(held.blocks)
        if self.window_pool is not None:
            self.window_pool.release(held.window_blocks)
        held.blocks, held.window_blocks, held.window_first = [], [], 0
        held.registered, held.parent_hash = 0, ROOT_HASH

    def rollback(self, held: RequestBlocks, keep: int) -> None:
        """`held` keeps positions [0, keep) only: blocks past them go back, so the next step writes position `keep`
        again (the rejected positions' keys and values are overwritten or unreachable). Registered blocks are never
        rolled back: register only positions that are kept."""
        if keep < held.registered * BLOCK_SIZE:
            raise ValueError(f"positions from {keep} on cannot be rolled back: {held.registered} blocks are registered "
                             "in the prefix cache")
        kept = blocks_for(keep)
        self.pool.release(held.blocks[kept:])
        del held.blocks[kept:]
        if self.window is not None:
            window_kept = max(0, kept - held.window_first)
            self.window_pool.release(held.window_blocks[window_kept:])
            del held.window_blocks[window_kept:]

    # -- prefix cache -------------------------------------------------------------------------------------

    def take_prefix(self, held: RequestBlocks, tokens: Sequence[int]) -> int:
        """Start `held` (holding nothing) from the longest cached prefix of `tokens` both pools can serve, at least
        one position left to compute (so the last token's logits exist to sample from); the positions it covers."""
        digests = self.pool.cached_chain(tokens, (len(tokens) - 1) // BLOCK_SIZE)
        reach = len(digests)
        while self.window is not None and reach and not all(
                self.window_pool.holds(d) for d in digests[self._window_first_block(reach):reach]):
            reach -= 1
        held.blocks = self.pool.take(digests[:reach])
        if self.window is not None:
            held.window_first = self._window_first_block(reach)
            held.window_blocks = self.window_pool.take(digests[held.window_first:reach])
        held.parent_hash = digests[reach - 1] if reach else ROOT_HASH
        held.registered = reach
        return reach * BLOCK_SIZE

    def _window_first_block(self, blocks: int) -> int:
        """The first block the window of position `blocks * BLOCK_SIZE` reaches."""
        return window_start(blocks * BLOCK_SIZE, self.window) // BLOCK_SIZE

    def register_full_blocks(self, held: RequestBlocks, tokens: Sequence[int], end: int) -> None:
        """`held`'s blocks whose every position is below `end` (scheduled, and kept) can serve later prompts: later
        steps' readers of them reach each stage after this step's writers (every stage runs the first stage's steps
        in order)."""
        for i in range(held.registered, end // BLOCK_SIZE):
            held.parent_hash = block_hash(held.parent_hash, tokens[i * BLOCK_SIZE:(i + 1) * BLOCK_SIZE])
            self.pool.register(held.blocks[i], held.parent_hash)
            if self.window is not None and i >= held.window_first:
                self.window_pool.register(held.window_blocks[i - held.window_first], held.parent_hash)
            held.registered = i + 1

    def clear(self) -> None:
        """Forget every cached block (the plan changed: the KV data is gone); blocks in use stay in use."""
        self.pool.clear_cache()
        if self.window_pool is not None:
            self.window_pool.clear_cache()
