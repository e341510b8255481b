"""The torch engine's linear layer and the CPU kernel choices behind it (oneDNN's packed and plain products, PyTorch's
own matrix-vector kernel for bfloat16 single rows), each measured fastest here for its case."""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager

import torch
import torch.nn.functional as F
from torch import nn


class Linear(nn.Linear):
    """nn.Linear that can run on oneDNN where that is the fastest CPU kernel (chosen in ShardModel.prepare).

    packed: the weight is stored in oneDNN's blocked layout, which every product then uses.
    onednn: a plain weight, every product through oneDNN (float32: faster than F.linear's GEMM at any row count).
    Measured on this project's 2-core CPU, whole SmolLM2-135M shape, float32: F.linear 41 ms per step for one row,
    46 ms for 8; oneDNN with weights packed for a batch of 16, 24 ms for one row and for 8 alike.
    """

    onednn = False
    packed = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.packed or self.onednn:
            return torch.ops.mkldnn._linear_pointwise(x, self.weight, self.bias, "none", [], "")
        return F.linear(x, self.weight, self.bias)

    def dense_weight(self) -> torch.Tensor:
        """The weight as a plain [out, in] tensor (a packed one is opaque: no slicing or reading)."""
        return self.weight.to_dense() if self.packed else self.weight


# Entries kept by each of oneDNN's two caches of compiled products (ideep's, then oneDNN's own). An entry serves
# one weight shape at one row count; a step with a row count not seen before compiles new ones (milliseconds), and
# at the libraries' default of 1,024 entries each, a serving node's many prefill chunk lengths grow its memory by
# hundreds of MB (bench/bench_onednn_cache.py shows it). Decode steps' few row counts stay cached.
ONEDNN_CACHE_ENTRIES = 64


def bound_onednn_caches() -> None:
    """Cap both caches unless the user set them; the libraries read these on their first product, so call it
    before the first (the engine does, when created). LRU_CACHE_CAPACITY is ideep's variable, in PyTorch."""
    for variable in ("ONEDNN_PRIMITIVE_CACHE_CAPACITY", "LRU_CACHE_CAPACITY"):
        os.environ.setdefault(variable, str(ONEDNN_CACHE_ENTRIES))


# oneDNN's batch-size hint for its packed weight layout, by dtype: the one measured fastest over 1 to 64 rows here
# (float32: packed for 16 rows is as fast for one row as for 8; bfloat16: packed for one row).
PACK_BATCH = {torch.float32: 16, torch.bfloat16: 1}


def onednn_usable(weight: torch.Tensor, pack_batch: int | None) -> bool:
    """Whether this build runs oneDNN's linear (a private op, as used by torch.compile) correctly on CPU for this
    weight's dtype, with a plain weight (pack_batch None) or one packed for that batch size."""
    if weight.device.type != "cpu" or not torch.backends.mkldnn.is_available():
        return False
    try:
        x, w = torch.ones(2, 32, dtype=weight.dtype), torch.ones(16, 32, dtype=weight.dtype)
        kernel_weight = w if pack_batch is None else torch.ops.mkldnn._reorder_linear_weight(w, pack_batch)
        out = torch.ops.mkldnn._linear_pointwise(x, kernel_weight, None, "none", [], "")
        return torch.equal(out, F.linear(x, w))
    except (AttributeError, RuntimeError, TypeError):  # a private op: any other build may lack or change it
        return False


@contextmanager
def native_matvec(enabled: bool) -> Iterator[None]:
    """For bfloat16 on CPU, PyTorch's own matrix-vector kernel streams a plain weight about twice as fast as
    the oneDNN one F.linear picks by default; turning oneDNN off for a single-row product selects it (the LM
    head, and every layer if packing is unavailable). Same results: float32 accumulation, one rounding."""
    if not enabled:
        yield
        return
    previous = torch.backends.mkldnn.enabled
    torch.backends.mkldnn.enabled = False
    try:
        yield
    finally:
        torch.backends.mkldnn.enabled = previous
