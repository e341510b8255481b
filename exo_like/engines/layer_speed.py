"""Timing one layer of a model's shape on an engine: the figure placement by speed divides layers by.

An engine builds one layer of the model's shape with random weights, held as its load would hold the model's
(device, dtype, quantized form), plus a KV pool for a short context (engines' `layer_runner`). This module times
it: a decode step (one new position after LAYER_CONTEXT cached ones, batch 1) and a prefill chunk of
PREFILL_CHUNK positions, after a warm-up of each.

A decode figure is the mean over a window of wall time, not the median of single steps: a CPU quota (a
container's or a cgroup's) lets a process run at full speed until its share of a scheduler period (100 ms by
default) is spent, then stops it until the period ends. The median of short steps would never see that; the mean
over a window longer than the period does. The decode figure is the median of DECODE_WINDOWS such windows of
DECODE_WINDOW seconds each, so one window disturbed by another process does not move it. The prefill figure is the
mean over PREFILL_WINDOW seconds (at least one chunk, whatever it takes). Time the engine thread waited while
other processes held the CPUs is left out (engines/cpu_wait.py): contention is the moment's, not the node's.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, replace

from exo_like.engines.cpu_wait import ContentionClock
from exo_like.engines.work import WorkItem, blocks_for
from exo_like.models.config import ModelArgs

PREFILL_CHUNK = 64  # positions of the timed prefill chunk
LAYER_CONTEXT = 64  # positions cached before the timed decode step
DECODE_WINDOW = 0.15  # seconds of decode steps per window (longer than one scheduler period)
DECODE_WINDOWS = 4
PREFILL_WINDOW = 0.3  # seconds of prefill chunks timed (at least one chunk whatever it takes)
MIN_STEPS = 3
# A timed mixture-of-experts layer holds this many experts per expert a token runs through: a step's time follows
# the experts its rows run (top k of them per row), not how many exist, and all of a large model's experts would
# take gigabytes for one probe.
MEASURED_EXPERTS_PER_CHOICE = 4


@dataclass(frozen=True)
class LayerSpeed:
    decode_ns: int  # one layer, one decode step of one sequence
    prefill_ns: int  # one layer, per position of a prefill chunk


def measured_layer(args: ModelArgs) -> tuple[ModelArgs, int]:
    """The (shape, absolute index) of the layer a probe times: a mixture-of-experts layer when the model has any
    (they are most of such a model's layers and its cost), with at most MEASURED_EXPERTS_PER_CHOICE x top-k
    experts; otherwise layer 0."""
    if args.moe is None or not args.moe.sparse_layers:
        return args, 0
    experts = min(args.moe.n_experts, MEASURED_EXPERTS_PER_CHOICE * args.moe.top_k)
    return replace(args, moe=replace(args.moe, n_experts=experts)), args.moe.sparse_layers[0]


@dataclass(frozen=True)
class LayerRunner:
    """One built layer: `decode` and `prefill` each run one step of it to completion (results on the device)."""

    decode: Callable[[], None]
    prefill: Callable[[], None]


def measure_items() -> tuple[WorkItem, WorkItem, int]:
    """(prefill item, decode item, KV blocks they need): the timed steps' positions in one pool."""
    n_blocks = blocks_for(max(PREFILL_CHUNK, LAYER_CONTEXT + 1))
    blocks = tuple(range(n_blocks))
    return (WorkItem("measure", "", 0, PREFILL_CHUNK, blocks), WorkItem("measure", "", LAYER_CONTEXT, 1, blocks),
            n_blocks)


def time_layer(runner: LayerRunner, decode_window: float = DECODE_WINDOW,
               prefill_window: float = PREFILL_WINDOW) -> LayerSpeed:
    runner.decode()  # warm-up: first-call allocations, kernel selection, caches
    runner.decode()
    windows = sorted(mean_ns(runner.decode, decode_window) for _ in range(DECODE_WINDOWS))
    decode_ns = (windows[(DECODE_WINDOWS - 1) // 2] + windows[DECODE_WINDOWS // 2]) // 2
    # The first chunk warms up too; when it alone outlasts the window (a slow device), it is the figure.
    prefill_ns = mean_ns(runner.prefill, 0.0, minimum=1)
    if prefill_ns < prefill_window * 1e9:
        prefill_ns = mean_ns(runner.prefill, prefill_window, minimum=1)
    return LayerSpeed(decode_ns, max(1, prefill_ns // PREFILL_CHUNK))


def mean_ns(step: Callable[[], None], window: float, minimum: int = MIN_STEPS) -> int:
    """Nanoseconds per call of `step`, over calls made until `window` seconds have passed (at least `minimum`),
    less the time the thread waited for a CPU that other processes held (not a quota's throttling: cpu_wait.py)."""
    started, contention = time.perf_counter_ns(), ContentionClock()
    calls = 0
    while True:
        step()
        calls += 1
        elapsed = time.perf_counter_ns() - started
        if calls >= minimum and elapsed >= window * 1e9:
            return max(1, (elapsed - min(contention.elapsed_ns(), elapsed)) // calls)
