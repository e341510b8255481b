"""The engine interface every framework implements (choice.py picks and creates one).

An engine holds one shard of one model and a pool of KV blocks for every request on this stage. `step` runs one
batch of work items (several requests' decode tokens and prompt chunks at once) and is called from one worker
thread at a time (the node serialises calls), so engines need no locking of their own.
"""

from __future__ import annotations

import ctypes
import gc
import logging
import sys
import threading
from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from exo_like.engines.activations import Activations
from exo_like.engines.layer_speed import LayerRunner, LayerSpeed, time_layer
from exo_like.engines.tensor_group import TensorGroup
from exo_like.engines.work import KVPoolSize, WorkItem
from exo_like.errors import ExoLikeError
from exo_like.models.config import ModelArgs
from exo_like.models.shard import Shard

log = logging.getLogger(__name__)


class EngineUnavailableError(ExoLikeError):
    status = 503
    type = "service_unavailable"


class LoadCancelled(Exception):
    """A load given up because its `cancel` event was set (a newer plan wants another range)."""


def check_cancel(cancel: threading.Event | None) -> None:
    """Call between a load's steps: raises LoadCancelled once the load is no longer wanted."""
    if cancel is not None and cancel.is_set():
        raise LoadCancelled


@dataclass
class WeightForms:
    """How the loaded shard holds a quantized checkpoint's matrices: run quantized (counted by stored type), or
    dequantized because no kernel of the engine takes them (counted by "type (reason)"), as the engine holds
    them (torch fuses q/k/v and gate/up into one matrix each). Both empty for a float checkpoint or a float
    --dtype."""

    quantized: dict[str, int] = field(default_factory=dict)
    dequantized: dict[str, int] = field(default_factory=dict)

    def add_quantized(self, type_name: str) -> None:
        self.quantized[type_name] = self.quantized.get(type_name, 0) + 1

    def add_dequantized(self, why: str) -> None:
        self.dequantized[why] = self.dequantized.get(why, 0) + 1

    def describe_dequantized(self) -> str:
        return ", ".join(f"{n} x {why}" for why, n in self.dequantized.items())


class Engine(ABC):
    name: str = ""

    def __init__(self, device: str | None = None, dtype: str | None = None):
        self.requested_device = device
        self.requested_dtype = dtype
        self.shard: Shard | None = None
        self.args: ModelArgs | None = None
        self.weight_forms = WeightForms()
        # Set when the engine is one rank of a tensor-parallel group (before loading a shard with `tp`).
        self.group: TensorGroup | None = None

    @abstractmethod
    def load(self, model_dir: Path, args: ModelArgs, shard: Shard, cancel: threading.Event | None = None) -> None:
        """Load the shard's tensors (only those, from only the files holding them). Replaces any loaded shard.

        Once `cancel` is set, stop at the next tensor (or group of tensors) with LoadCancelled, holding nothing."""

    @abstractmethod
    def step(self, items: Sequence[WorkItem], inputs: np.ndarray | Activations) -> Activations | np.ndarray:
        """Run the shard on one batch: each item's new positions, writing their keys and values to the item's
        KV blocks and attending to the item's positions [0, end) only.

        inputs: the items' rows in order: token ids (int, [R]) on the first shard, else the previous shard's
        hidden states [R, H]. Returns hidden states [R, H] as Activations, or on the last shard the float32
        logits [S, vocab] of the last row of each item that samples (in item order).
        Raises InvalidRequestError if an item does not fit the pool or the context.
        """

    def follow(self, items: Sequence[WorkItem], hidden: Activations) -> None:
        """A tensor-parallel follower's part of its leader's step: its slice of the layers over the hidden states
        the leader embedded (or received), in lockstep with the group. Nothing comes back: the leader has it all."""
        raise NotImplementedError(f"the {self.name} engine does not run in tensor-parallel groups")

    @abstractmethod
    def layer_form(self, model_dir: Path, args: ModelArgs) -> str:
        """How this engine would hold the model's layers (dtype, quantized form), in words: part of the key a
        measured layer speed is cached under. Cheap: reads no weights."""

    @abstractmethod
    def layer_runner(self, model_dir: Path, args: ModelArgs) -> LayerRunner:
        """One layer of the model's shape with random weights, held as `load` would hold the model's layers, and
        a KV pool for it (see layer_speed.py). Replaces nothing the engine holds."""

    def measure_layer(self, model_dir: Path, args: ModelArgs) -> LayerSpeed:
        """Time one layer of the model's shape on this engine, device and dtype (call on the engine thread)."""
        return time_layer(self.layer_runner(model_dir, args))

    @abstractmethod
    def kv_block_bytes(self) -> tuple[int, int]:
        """Bytes one KV block takes for the loaded shard's layers: (layers attending to every position,
        sliding-window layers), each group in a pool of its own."""

    @abstractmethod
    def allocate_kv(self, n_blocks: int, n_window_blocks: int | None = None) -> None:
        """Make the pool `n_blocks` blocks, the sliding-window layers' `n_window_blocks` (default the same) (after
        load; a load drops the pool)."""

    @property
    @abstractmethod
    def kv_size(self) -> KVPoolSize | None:
        """The pool's size (None before allocate_kv)."""

    @property
    def kv_window(self) -> int | None:
        """The loaded model's sliding window, whose layers have a pool of their own (None: none, or no model)."""
        return None if self.args is None else self.args.kv_window

    @property
    def kv_blocks(self) -> int:
        """Blocks in the full-attention layers' pool (0 before allocate_kv)."""
        return 0 if self.kv_size is None else self.kv_size.blocks

    def _log_pool(self, size: KVPoolSize | None) -> None:
        if size is None:
            return
        full, windowed = self.kv_block_bytes()
        megabytes = (size.blocks * full + (size.window_blocks or 0) * windowed) / 1e6
        window = "" if size.window_blocks is None else f" + {size.window_blocks} sliding-window blocks"
        log.info("KV pool: %d blocks%s (%.1f MB) for %s", size.blocks, window, megabytes, self.shard)

    def place_threads(self) -> None:
        """Called on the engine thread after each load: settle where the framework's compute threads run.
        Most engines leave that to the operating system."""

    def unload(self) -> None:
        """Drop the loaded shard and its KV pool, and give their memory back (an instance this node no longer
        takes part in: its memory goes to another). Call on the engine thread."""
        self.shard, self.args, self.weight_forms = None, None, WeightForms()
        free_replaced_shard()

    def close(self) -> None:
        """Called on the engine thread when the node stops, before that thread ends: release what the framework
        keeps per thread. The engine is not used afterwards. Most engines keep nothing there."""

    @abstractmethod
    def parameter_bytes(self) -> int:
        """Bytes of the loaded shard's parameters."""

    @property
    @abstractmethod
    def device_name(self) -> str:
        """Human description, e.g. 'cpu', 'cuda:0 (NVIDIA RTX 4090)', 'mlx gpu'."""

    @property
    @abstractmethod
    def on_cpu(self) -> bool:
        """Whether the layers run on the CPU (the scheduler sizes its steps for it)."""

    @property
    @abstractmethod
    def dtype_name(self) -> str:
        """The dtype weights and activations use: float32, bfloat16 or float16."""

    def numerics(self) -> dict[str, str]:
        """What the hardware changes in how this engine computes (kernel paths chosen by CPU feature), by name;
        empty where nothing is chosen by it, and until the first load (engines probe the hardware on their thread)."""
        return {}


def return_freed_memory() -> None:
    """Hand the heap's free pages back to the system (glibc only; elsewhere nothing to do).

    A load frees its temporaries (read and unpacked weights) in many pieces; glibc keeps freed heap memory for
    reuse, so without this a node's resident memory stays at the load's peak instead of the weights it holds."""
    if sys.platform != "linux":
        return
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):  # another C library (musl has neither)
        pass


def free_replaced_shard() -> None:
    """After an engine dropped its references to the shard it held: free it now, before the next is read.

    A model's modules reference each other (cycles), so dropping the engine's reference leaves them to a later
    garbage collection: a re-plan would hold the old shard beside the new one at its peak, and the load's trim
    would run before the old shard is freed, so a node that gave layers away kept their memory."""
    gc.collect()
    return_freed_memory()
