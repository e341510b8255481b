"""What an engine sees of the tensor-parallel group it is one rank of (exo_like/tensor_parallel/ forms the group,
runs each rank in a worker process and implements this).

Every rank holds a slice of every layer of the stage (models/tensor_split.py). The leader (rank 0) runs the
stage's steps: after embedding it shares the step (work items and first hidden states) with the followers, then
all ranks run the layers in lockstep, adding their partial outputs with `all_reduce` twice a layer."""

from __future__ import annotations

import statistics
import time
from abc import ABC, abstractmethod
from collections.abc import Sequence
from typing import Any

import numpy as np

from exo_like.engines.activations import Activations
from exo_like.engines.work import WorkItem


LAYER_STAND_IN_BYTES = 16 << 20  # a 7-8B model's layer half in 4 bits; ~1.5 ms on these machines


class TensorGroup(ABC):
    rank: int
    size: int

    @abstractmethod
    def all_reduce(self, tensor: Any) -> Any:
        """The sum of every rank's `tensor` (the engine's framework array), on every rank bit for bit the same
        (routers on each rank must choose the same experts). May work in place; returns the sum."""

    @abstractmethod
    def share_step(self, items: Sequence[WorkItem], hidden: Activations) -> None:
        """Leader only: hand the followers the step it is about to run through the layers."""

    def time_all_reduce(self, width: int, times: int) -> int:
        """Nanoseconds one all-reduce of [1, width] takes as a step makes it, the median of `times` (every rank
        calls it at once): each right after reading a layer's worth of memory, as a step's come after a layer's
        half. Back to back, the same sums take about half as long as in a step (two one-core hosts: gloo 0.3 ms
        against 0.5, MLX's ring 0.18 against 0.36): the collective's threads and buffers have gone cold."""
        layer = np.ones(LAYER_STAND_IN_BYTES // 4, dtype=np.float32)
        samples = []
        for _ in range(times + 3):  # the first few set up buffers and connections
            layer.sum()  # one thread (numpy's reductions start none)
            tensor = self.zeros(width)
            started = time.perf_counter_ns()
            self.wait(self.all_reduce(tensor))
            samples.append(time.perf_counter_ns() - started)
        return int(statistics.median(samples[3:]))

    def zeros(self, width: int) -> Any:
        """A [1, width] float32 array of the group's framework."""
        raise NotImplementedError

    def wait(self, array: Any) -> None:
        """Until `array` is computed (frameworks that compute lazily)."""
