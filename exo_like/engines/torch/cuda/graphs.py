"""CUDA graphs of a shard's decode steps: a step of one new position per request, launched as one graph instead of
a few hundred kernels one by one (on a small model the launches cost more than reading the weights).

A graph replays fixed shapes from fixed buffers, so a decode step is run padded: its rows to a bucket of ROWS
and every request's positions to a bucket of POSITIONS, in static buffers the step's values are copied into before
the replay: the token ids (or the hidden states of a later stage), each row's position (its rotary cos and sin are
gathered on the GPU from the shard's tables, made long enough once), the slot its key and value go to, and the
padded table of slots each row attends to with its mask (the layers' own decode path, attention.DecodeGroup). A
padding row computes on token 0 at position 0, writes its key and value to the pool's spare block (KVPool's
`spare`, which no request holds) and attends to that slot alone; its output is dropped. One graph per (rows,
positions) bucket, captured on first use, all sharing one memory pool.

The same padded step runs eagerly where graphs cannot be captured (CPU), which is how the suite checks that it
computes what the unpadded step does (tests/engines/test_decode_graphs.py); the capture itself runs on a GPU only
(bench/cuda_check.py).

Not captured (`refusal`): mixtures of experts (their routing picks each expert's rows on the host), sliding-window
layers (a second pool's tables), tensor-parallel ranks (the group's collectives run outside the graph here)."""

from __future__ import annotations

import bisect
from dataclasses import dataclass

import numpy as np
import torch

from exo_like.engines.batch import BLOCK_SIZE, BatchLayout
from exo_like.engines.torch.attention import DecodeGroup, KVPool, item_slots

ROWS = (1, 2, 4, 8, 16, 32)  # rows buckets: a step of more rows runs uncaptured
POSITIONS = tuple(2 ** n for n in range(7, 18))  # 128 ... 131072 positions a row attends to


def refusal(model) -> str | None:  # noqa: ANN001 - a ShardModel (model.py imports this module)
    """Why the shard's decode steps cannot run as graphs (None if they can)."""
    args = model.args
    if args.moe is not None:
        return "a mixture of experts (its routing picks rows on the host)"
    if args.kv_window is not None:
        return "sliding-window layers"
    if model.reduces:
        return "a tensor-parallel rank"
    return None


@dataclass
class StaticIndex:
    """What the layers read of a StepIndex, for a padded decode step: every row a request of its own."""

    write_slots: torch.Tensor
    decode: DecodeGroup
    singles: tuple = ()
    windowed: None = None


class Bucket:
    """The static buffers of one (rows, positions) bucket, and its graph once captured."""

    def __init__(self, model, rows: int, positions: int, device: torch.device, scratch: int):  # noqa: ANN001
        self.rows, self.positions = rows, positions
        first = model.embed_tokens is not None
        self.inputs = torch.zeros(rows, dtype=torch.long, device=device) if first else \
            torch.zeros(rows, model.args.hidden_size, dtype=model.norm_weight.dtype, device=device)
        self.row_positions = torch.zeros(rows, dtype=torch.long, device=device)
        self.write_slots = torch.full((rows,), scratch, dtype=torch.long, device=device)
        self.slots = torch.full((rows * positions,), scratch, dtype=torch.long, device=device)
        self.mask = torch.zeros(rows, 1, 1, positions, dtype=torch.bool, device=device)
        self.index = StaticIndex(self.write_slots, DecodeGroup(torch.arange(rows, device=device), 0, self.slots,
                                                               self.mask))
        self.graph: torch.cuda.CUDAGraph | None = None
        self.output: torch.Tensor | None = None

    def fill(self, layout: BatchLayout, inputs: torch.Tensor, scratch: int) -> None:
        """The step's values into the buffers; the rows past its own, padding. On the device, a row's own
        positions only: no host table of the whole bucket a step (up to rows x 131072 slots)."""
        n = layout.rows
        self.slots.fill_(scratch)
        self.mask.zero_()
        self.mask[..., 0] = True  # a padding row sees its one scratch slot (no row may see nothing: NaN)
        table = self.slots.view(self.rows, self.positions)
        for i, item in enumerate(layout.items):
            table[i, :item.end].copy_(torch.from_numpy(item_slots(item)))
            self.mask[i, ..., :item.end] = True
        self.inputs[:n].copy_(inputs)
        self.inputs[n:].zero_()
        self.row_positions.copy_(torch.from_numpy(np.pad(layout.positions, (0, self.rows - n))))
        self.write_slots.copy_(torch.from_numpy(np.pad(layout.write_slots, (0, self.rows - n),
                                                       constant_values=scratch)))


class DecodeGraphs:
    """A shard's decode steps as CUDA graphs (`capture`), or the same padded steps run eagerly (CPU: tests)."""

    def __init__(self, model, pool: KVPool, capture: bool):  # noqa: ANN001
        if pool.spare < 1:
            raise ValueError("decode graphs need a pool with a spare block for their padding rows")
        self.model, self.pool, self.capture = model, pool, capture
        self.device = model.norm_weight.device
        self.scratch = pool.n_blocks * BLOCK_SIZE  # the spare block's first slot
        self.buckets: dict[tuple[int, int], Bucket] = {}
        self.memory = torch.cuda.graph_pool_handle() if capture else None
        for table in model.ropes.values():  # long enough for every position now: a graph keeps its tensors
            table.extend(pool.n_blocks * BLOCK_SIZE)

    def bucket_for(self, layout: BatchLayout) -> tuple[int, int] | None:
        """The (rows, positions) bucket of a decode step, None for a step this does not run."""
        if not layout.items or any(item.count != 1 for item in layout.items):
            return None
        sampled = layout.sample_rows
        if self.model.lm_head is not None and not np.array_equal(sampled, np.arange(layout.rows)):
            return None  # (a last stage's decode step samples every row, in order)
        longest = max(item.end for item in layout.items)
        rows = bisect.bisect_left(ROWS, layout.rows)
        positions = bisect.bisect_left(POSITIONS, longest)
        if rows == len(ROWS) or positions == len(POSITIONS):
            return None
        return ROWS[rows], POSITIONS[positions]

    def run(self, layout: BatchLayout, inputs: torch.Tensor) -> torch.Tensor:
        """The step's output (logits [rows, vocab] on a last shard, else hidden states [rows, H]) for a step
        bucket_for takes. The result is the bucket's buffer: read it before the next step."""
        key = self.bucket_for(layout)
        assert key is not None
        bucket = self.buckets.get(key)
        if bucket is None:
            bucket = self.buckets[key] = Bucket(self.model, *key, self.device, self.scratch)
        bucket.fill(layout, inputs, self.scratch)
        if not self.capture:
            return self._body(bucket)[:layout.rows]
        if bucket.graph is None:
            self._capture(bucket)
        bucket.graph.replay()
        return bucket.output[:layout.rows]

    def _body(self, bucket: Bucket) -> torch.Tensor:
        model = self.model
        h = model.embed(bucket.inputs)
        ropes = {key: table.at(bucket.row_positions) for key, table in model.ropes.items()}
        h = model.run_layers(h, self.pool, bucket.index, ropes)
        return model.logits(h) if model.lm_head is not None else h

    def _capture(self, bucket: Bucket) -> None:
        side = torch.cuda.Stream(self.device)
        side.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(side):  # warm-up runs off the capture (lazy initialisations, cuBLAS workspaces)
            for _ in range(2):
                self._body(bucket)
        torch.cuda.current_stream(self.device).wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.memory):
            bucket.output = self._body(bucket)
        bucket.graph = graph
