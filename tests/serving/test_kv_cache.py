"""The KV cache in-process: the block pool (kv_blocks.py) and the manager of each request's blocks in both pools
(kv_cache.py): allocation in runs, both pools or neither, sliding windows, the prefix cache, rollback."""

from __future__ import annotations

import pytest

from exo_like.engines.work import BLOCK_SIZE, blocks_for, window_start
from exo_like.serving.kv_blocks import BlockPool, block_hash
from exo_like.serving.kv_cache import KVCache, RequestBlocks


# -- the pool ---------------------------------------------------------------------------------------------


def test_pool_hands_out_lowest_blocks_and_takes_them_back() -> None:
    pool = BlockPool(4)
    assert pool.allocate(2) == [0, 1]
    assert pool.allocate(3) is None and pool.available == 2  # nothing taken on failure
    pool.release([0])
    assert pool.allocate(1) == [0]
    pool.release([0])
    assert pool.allocate(2) == [2, 3]  # a run of consecutive blocks rather than the lowest ones
    pool.release([2, 3])
    assert pool.allocate(3) == [0, 2, 3] and pool.used == 4  # no run that long: the lowest ones


def test_pool_continues_a_requests_run_when_the_next_blocks_are_free() -> None:
    pool = BlockPool(8)
    first, other = pool.allocate(2), pool.allocate(1)
    assert (first, other) == ([0, 1], [2])
    assert pool.allocate(1, after=first[-1]) == [3]  # block 2 is taken: the lowest free one instead
    assert pool.allocate(2, after=other[-1]) == [4, 5]
    assert pool.allocate(1, after=5) == [6]
    assert pool.allocate(1, after=7) == [7]  # nothing after the last block: the lowest free one


def test_pool_keeps_cached_blocks_until_their_space_is_needed() -> None:
    pool = BlockPool(3)
    tokens = list(range(2 * BLOCK_SIZE))
    blocks = pool.allocate(2)
    parent = b""
    for i, block in enumerate(blocks):
        parent = block_hash(parent, tokens[i * BLOCK_SIZE:(i + 1) * BLOCK_SIZE])
        pool.register(block, parent)
    pool.release(blocks)
    assert pool.cached == 2 and pool.available == 3 and pool.used == 2
    hit = pool.take(pool.cached_chain(tokens + [99], 2))
    assert hit == blocks
    pool.release(hit)
    # A different first block shares nothing, even if the second block's tokens are the same.
    assert pool.cached_chain([1] + tokens[1:], 2) == []
    # Needing every block evicts the cached ones, oldest first.
    assert sorted(pool.allocate(3)) == [0, 1, 2] and pool.cached == 0


# -- the manager --------------------------------------------------------------------------------------------


def test_blocks_come_in_both_pools_or_in_neither() -> None:
    cache = KVCache(8, window=BLOCK_SIZE, n_window_blocks=2)
    held = RequestBlocks()
    assert cache.allocate(held, 3 * BLOCK_SIZE, 2 * BLOCK_SIZE)
    assert (held.blocks, held.window_blocks) == ([0, 1, 2], [0, 1])
    other = RequestBlocks()
    assert not cache.allocate(other, BLOCK_SIZE, BLOCK_SIZE)  # the window pool is full: nothing taken in the other
    assert other.blocks == [] and cache.pool.available == 5
    assert cache.allocate(held, 3 * BLOCK_SIZE, 2 * BLOCK_SIZE) and held.blocks == [0, 1, 2]  # held already
    cache.free(held)
    assert cache.pool.available == 8 and cache.window_pool.available == 2 and held.blocks == held.window_blocks == []


def test_a_window_gives_back_the_blocks_it_no_longer_reaches() -> None:
    window = BLOCK_SIZE + 4
    cache = KVCache(16, window=window, n_window_blocks=16)
    held = RequestBlocks()
    end = 5 * BLOCK_SIZE
    assert cache.allocate(held, end, end)
    cache.slide(held, end)
    first = window_start(end, window) // BLOCK_SIZE
    assert held.window_first == first and len(held.window_blocks) == 5 - first
    assert cache.window_pool.available == 16 - (5 - first)
    assert cache.held_positions(held) == end and len(held.blocks) == 5  # the first pool keeps every block


def test_a_prompt_starts_from_the_longest_prefix_both_pools_hold() -> None:
    window = BLOCK_SIZE
    cache = KVCache(16, window=window, n_window_blocks=16)
    tokens = list(range(4 * BLOCK_SIZE + 3))
    first = RequestBlocks()
    assert cache.allocate(first, len(tokens), len(tokens))
    cache.register_full_blocks(first, tokens, len(tokens))
    assert first.registered == 4
    cache.free(first)  # registered blocks stay cached in both pools
    second = RequestBlocks()
    assert cache.take_prefix(second, tokens) == 4 * BLOCK_SIZE
    assert second.blocks == [0, 1, 2, 3] and second.window_first == window_start(4 * BLOCK_SIZE, window) // BLOCK_SIZE
    cache.free(second)
    cache.window_pool.clear_cache()  # the windows are gone: nothing can be served
    third = RequestBlocks()
    assert cache.take_prefix(third, tokens) == 0 and third.blocks == []


def test_a_prompt_of_whole_cached_blocks_keeps_its_last_position_to_compute() -> None:
    cache = KVCache(8)
    tokens = list(range(2 * BLOCK_SIZE))
    held = RequestBlocks()
    assert cache.allocate(held, len(tokens), len(tokens))
    cache.register_full_blocks(held, tokens, len(tokens))
    cache.free(held)
    assert cache.take_prefix(RequestBlocks(), tokens) == BLOCK_SIZE


def test_rolled_back_positions_give_their_blocks_back() -> None:
    cache = KVCache(8, window=BLOCK_SIZE, n_window_blocks=8)
    held = RequestBlocks()
    assert cache.allocate(held, 2 * BLOCK_SIZE + 5, 2 * BLOCK_SIZE + 5)  # a step of speculated positions
    cache.rollback(held, BLOCK_SIZE + 1)  # only these were accepted
    assert held.blocks == [0, 1] and held.window_blocks == [0, 1] and cache.pool.available == 6
    assert cache.window_pool.available == 6
    cache.rollback(held, BLOCK_SIZE + 1)  # nothing more to give back
    assert cache.pool.available == 6
    assert cache.allocate(held, 3 * BLOCK_SIZE, 3 * BLOCK_SIZE) and held.blocks == [0, 1, 2]  # the run goes on


def test_registered_blocks_cannot_be_rolled_back() -> None:
    cache = KVCache(8)
    tokens = list(range(2 * BLOCK_SIZE))
    held = RequestBlocks()
    assert cache.allocate(held, len(tokens), len(tokens))
    cache.register_full_blocks(held, tokens, BLOCK_SIZE)
    cache.rollback(held, BLOCK_SIZE)  # positions past the registered block: fine
    assert held.blocks == [0]
    with pytest.raises(ValueError, match="registered"):
        cache.rollback(held, BLOCK_SIZE - 1)


def test_only_blocks_below_the_kept_end_are_registered() -> None:
    cache = KVCache(8)
    tokens = list(range(3 * BLOCK_SIZE))
    held = RequestBlocks()
    assert cache.allocate(held, len(tokens), len(tokens))
    cache.register_full_blocks(held, tokens, 2 * BLOCK_SIZE - 1)
    assert held.registered == 1 and cache.pool.cached == 1
    cache.register_full_blocks(held, tokens, blocks_for(len(tokens)) * BLOCK_SIZE)
    assert held.registered == 3 and cache.pool.cached == 3
