"""Keeping long-lived objects out of the garbage collector's passes in the test processes (gc.freeze): an engine's
load runs a full collection (engines/base.py), which otherwise walks every object torch, transformers and mlx
imported and every checkpoint and oracle answer a file keeps. tests/conftest.py offers both as fixtures."""

from __future__ import annotations

import gc
from collections.abc import Iterator
from contextlib import contextmanager


@contextmanager
def long_lived_objects_frozen() -> Iterator[None]:
    """Within: every object alive on entry sits in the garbage collector's permanent generation (gc.freeze), and so
    does all that lives when `freeze_what_lives_now` is called. An engine's load runs a full collection
    (engines/base.py: free_replaced_shard, so a replaced shard's cycles are freed before the next is read); in a
    test process that collection otherwise walks the hundreds of thousands of objects torch, transformers and mlx
    import (and a module's checkpoints and oracles), half a second a load. Frozen, it walks only what the tests made
    since. On exit all is unfrozen and collected: nothing frozen outlives the block."""
    gc.collect()
    gc.freeze()
    try:
        yield
    finally:
        gc.unfreeze()
        gc.collect()


def freeze_what_lives_now() -> None:
    """Within `long_lived_objects_frozen`: collect the garbage made since the last freeze, then freeze what still
    lives as well (e.g. at each test's start, or after an oracle imported its model's code). Cheap when done often:
    the collection walks only what was made since."""
    gc.collect()
    gc.freeze()
