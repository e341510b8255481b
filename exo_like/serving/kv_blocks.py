"""The ring's KV cache as fixed-size blocks: which block ids are free, which hold what, and the prefix cache.

Every stage keeps keys and values in a pool of `BLOCK_SIZE`-position blocks (its own layers only, see the
engines). The first stage alone decides which block ids a request uses and sends the block table along with
its rows, so all stages hold a request at the same block ids and no stage needs an allocator of its own. Equal
block sizes mean requests of any length share the pool without fragmenting it.

Prefix cache: a block whose positions are all scheduled is registered under a hash of its tokens and of every
token before it. A finished request's registered blocks stay in the pool (least recently used first out) until
their space is needed, and a new request whose prompt starts with the same tokens takes them instead of
computing them again. Only full blocks are shared, and a shared block is never written again.

Sliding-window layers (gpt-oss, Gemma 2/3, Mistral 7B v0.1) keep their keys and values in a second pool, where a
request holds only the blocks its window still reaches: older ones go back as the request moves on (to the
prefix cache's least-recently-used list if registered). A cached prefix serves a new request when both pools hold
what it needs: every block in the first, the blocks its window reaches in the second.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from collections.abc import Sequence

import numpy as np
import psutil

from exo_like.engines.work import BLOCK_SIZE, KVPoolSize, blocks_for

# A node's KV cache unless --kv-cache-gb says otherwise: this share of the memory left after loading its layers, at
# most DEFAULT_KV_CAP bytes (torch takes pages only as blocks are first written; MLX on a CPU fills the pool at load).
DEFAULT_KV_SHARE = 0.3
DEFAULT_KV_CAP = 2 * 2**30


def kv_budget_bytes(kv_cache_gb: float | None) -> int:
    if kv_cache_gb is not None:
        return int(kv_cache_gb * 2**30)
    return int(min(DEFAULT_KV_CAP, DEFAULT_KV_SHARE * psutil.virtual_memory().available))


# Requests whose whole windows the sliding-window pool holds at once (at most the running limit): a home cluster
# serves a few users at a time, and a model with long windows (Gemma 3's 1,024 over 51 of 62 layers) would spend
# most of the budget on windows for 64. More long requests than this share the pool by preemption (they wait, and
# their text does not change).
WINDOW_REQUESTS = 16


def pool_sizes(budget: int, block_bytes: tuple[int, int], window: int | None, requests: int, step_rows: int,
               context_length: int) -> KVPoolSize:
    """A stage's KV pools within `budget` bytes, given the bytes of a block in each (full-attention layers,
    sliding-window layers; Engine.kv_block_bytes).

    A request holds about its window's blocks in the sliding-window pool, so that pool is made big enough for
    `requests` windows (the scheduler's running limit, at most WINDOW_REQUESTS) and one step's prompt chunk of
    `step_rows`, and the rest of the budget goes to the other pool: more positions than one pool for all layers
    would give. A budget smaller than that splits evenly (the window pool never needs more blocks than the other:
    a request holds no more window blocks than full ones). A stage holding no full-attention layer names blocks it
    does not store: enough ids for `requests` whole contexts.

    Neither pool is made bigger than `requests` whole contexts and one step's chunk could fill (a small model's
    default budget would otherwise hold hundreds of them): the rest would only ever keep finished requests'
    prefixes, and an engine that cannot leave pages untouched until they are written (MLX on a CPU fills its pool
    at allocation) pays for every block at load."""
    full, windowed = block_bytes
    fillable = requests * blocks_for(context_length) + blocks_for(step_rows)
    if not windowed:
        return KVPoolSize(max(1, min(fillable, budget // full)))
    if not full:
        return KVPoolSize(requests * blocks_for(context_length), max(1, min(fillable, budget // windowed)))
    even = max(1, budget // (full + windowed))  # what one pool for all layers would hold
    windows = min(requests, WINDOW_REQUESTS) * (blocks_for(window) + 2) + blocks_for(step_rows)
    if even <= windows:
        return KVPoolSize(even, even)
    return KVPoolSize(min(fillable, (budget - windows * windowed) // full), windows)


def block_hash(parent: bytes, tokens: Sequence[int]) -> bytes:
    """Identifies a full block by its tokens and, through `parent`, every token before it."""
    digest = hashlib.blake2b(parent, digest_size=16)
    digest.update(b"".join(int(t).to_bytes(4, "little") for t in tokens))
    return digest.digest()


ROOT_HASH = b""


class BlockPool:
    """Block ids 0..n_blocks-1: free ones, reference counts of used ones, and the prefix cache (hash -> block)
    with its least-recently-used order.

    Blocks are handed out lowest first, so the pool's memory that is touched stays small, and in consecutive
    runs where possible: a request whose positions sit in consecutive blocks is attended to from a view of the
    engine's pool, while scattered blocks are gathered in every layer of every step (for a long prompt, the
    gather costs more than its attention)."""

    def __init__(self, n_blocks: int):
        if n_blocks < 1:
            raise ValueError("a KV pool needs at least one block")
        self.n_blocks = n_blocks
        self._is_free = np.ones(n_blocks, dtype=bool)
        self._n_free = n_blocks
        self._refs = [0] * n_blocks
        self._hash_of: dict[int, bytes] = {}
        self._by_hash: dict[bytes, int] = {}
        self._evictable: OrderedDict[int, None] = OrderedDict()  # cached blocks no request uses, oldest first

    # -- counts -----------------------------------------------------------------------------------------

    @property
    def available(self) -> int:
        """Blocks a request can get now: free ones plus cached ones nobody uses (evicted on demand)."""
        return self._n_free + len(self._evictable)

    @property
    def used(self) -> int:
        """Blocks that hold something: used by a request, or kept by the prefix cache."""
        return self.n_blocks - self._n_free

    @property
    def cached(self) -> int:
        return len(self._by_hash)

    # -- allocation -------------------------------------------------------------------------------------

    def allocate(self, count: int, after: int | None = None) -> list[int] | None:
        """`count` blocks for one request's exclusive use, evicting unused cached blocks if needed; None (and
        nothing taken) if there are not enough. Preferred, in order: the blocks right after block `after` (the
        request's last one, so its run goes on), the lowest run of `count` consecutive free blocks, the lowest
        free blocks."""
        if count > self.available:
            return None
        while self._n_free < count:
            self._evict_oldest()
        blocks = self._following(after, count) or self._lowest_run(count) or self._lowest(count)
        self._is_free[blocks] = False
        self._n_free -= count
        for block in blocks:
            self._refs[block] = 1
        return blocks

    def _following(self, after: int | None, count: int) -> list[int] | None:
        if after is None or after + count >= self.n_blocks or not self._is_free[after + 1:after + 1 + count].all():
            return None
        return list(range(after + 1, after + 1 + count))

    def _lowest_run(self, count: int) -> list[int] | None:
        if count < 2:
            return None
        # Start and end of every run of free blocks, from the edges of the free mask.
        edges = np.diff(np.concatenate(([False], self._is_free, [False])).astype(np.int8))
        starts, ends = np.flatnonzero(edges == 1), np.flatnonzero(edges == -1)
        fitting = np.flatnonzero(ends - starts >= count)
        if fitting.size == 0:
            return None
        start = int(starts[fitting[0]])
        return list(range(start, start + count))

    def _lowest(self, count: int) -> list[int]:
        return np.flatnonzero(self._is_free)[:count].tolist()

    def _set_free(self, block: int) -> None:
        self._is_free[block] = True
        self._n_free += 1

    def release(self, blocks: Sequence[int]) -> None:
        """A request is done with its blocks: cached ones stay (evictable), the others are free again."""
        for block in blocks:
            self._refs[block] -= 1
            if self._refs[block] > 0:
                continue
            if block in self._hash_of:
                self._evictable[block] = None
            else:
                self._set_free(block)

    def _evict_oldest(self) -> None:
        block, _ = self._evictable.popitem(last=False)
        del self._by_hash[self._hash_of.pop(block)]
        self._set_free(block)

    # -- prefix cache -----------------------------------------------------------------------------------

    def cached_chain(self, tokens: Sequence[int], limit: int) -> list[bytes]:
        """Hashes of the leading whole blocks of `tokens` (at most `limit`) that this pool holds, in order."""
        digests: list[bytes] = []
        parent = ROOT_HASH
        for i in range(limit):
            parent = block_hash(parent, tokens[i * BLOCK_SIZE:(i + 1) * BLOCK_SIZE])
            if parent not in self._by_hash:
                break
            digests.append(parent)
        return digests

    def holds(self, digest: bytes) -> bool:
        return digest in self._by_hash

    def take(self, digests: Sequence[bytes]) -> list[int]:
        """The cached blocks holding `digests` (all held), now also used by the caller (release them as usual)."""
        blocks = [self._by_hash[digest] for digest in digests]
        for block in blocks:
            if self._refs[block] == 0:
                del self._evictable[block]
            self._refs[block] += 1
        return blocks

    def register(self, block: int, digest: bytes) -> None:
        """`block` (used by the caller) is full and holds the tokens `digest` names: later prompts may share it.
        If another block already holds the same tokens, this one stays private."""
        if digest in self._by_hash or block in self._hash_of:
            return
        self._by_hash[digest] = block
        self._hash_of[block] = digest

    def clear_cache(self) -> None:
        """Forget every cached block (the KV data is gone, e.g. a stage reloaded); used blocks stay used."""
        for block in list(self._evictable):
            self._set_free(block)
        self._evictable.clear()
        self._hash_of.clear()
        self._by_hash.clear()
