"""One random layer of a model's shape on the torch engine, built the way a load builds a shard: the same fused
projections, quantized kernels, weight layouts (ShardModel.prepare) and KV pool. What layer_speed.py times."""

from __future__ import annotations

import math
from collections.abc import Callable

import numpy as np
import torch

from exo_like.engines.layer_speed import LayerRunner, measure_items, measured_layer
from exo_like.engines.torch.attention import step_index
from exo_like.engines.torch.model import ShardModel, fuse_checkpoint_weights, load_state
from exo_like.engines.torch.cuda.matrix import triton_available
from exo_like.engines.torch.install import Installer
from exo_like.engines.torch.loading import hold_half
from exo_like.engines.torch.mla import per_head_matrices
from exo_like.engines.torch.int4 import int4_kernel_available
from exo_like.engines.torch.quant import Matrix, native_kernels
from exo_like.engines.work import WorkItem
from exo_like.models.affine import AffineGroups
from exo_like.models.config import ModelArgs
from exo_like.models.families.deepseek import split_kv_b
from exo_like.models.parameters import layer_shapes
from exo_like.models.quantization import QuantSpec

TILE = 1 << 16  # random values drawn per tensor; a large matrix repeats them (the kernels' speed does not care)
WEIGHT_SCALE = 0.02  # keeps activations in range through the timed steps


def random_tensor(shape: tuple[int, ...], generator: torch.Generator) -> torch.Tensor:
    """float32 values of scale WEIGHT_SCALE: one tile of random values repeated (fast for large matrices)."""
    numel = math.prod(shape)
    tile = torch.randn(min(numel, TILE), generator=generator) * WEIGHT_SCALE
    return tile.repeat(-(-numel // tile.numel()))[:numel].reshape(shape)


def random_groups(shape: tuple[int, ...], quant: QuantSpec, rng: np.random.Generator) -> AffineGroups:
    out, inputs = shape
    codes = rng.integers(0, 2**quant.bits, size=(out, inputs), dtype=np.uint8)
    groups = (out, inputs // quant.group_size)
    # float16 values, as a checkpoint's "half" form stores them: the kernels a load picks for it run here too
    scales = np.full(groups, WEIGHT_SCALE / 2**quant.bits, dtype=np.float16).astype(np.float32)
    biases = np.full(groups, -WEIGHT_SCALE / 2, dtype=np.float16).astype(np.float32)
    return AffineGroups(codes, scales, biases, quant.bits, quant.group_size, f"mlx {quant.bits}-bit")


def layer_runner(args: ModelArgs, device: torch.device, dtype: torch.dtype, quant: QuantSpec | None,
                 half: torch.dtype | None = None) -> LayerRunner:
    """The layer and its two timed steps. quant: hold the matrices quantized so (None: in `dtype`, or with
    `half` in that 16-bit dtype beside `dtype` activations, as engine.half_storage holds a checkpoint's)."""
    generator, rng = torch.Generator().manual_seed(0), np.random.default_rng(0)
    args, layer = measured_layer(args)
    weights: dict[str, Matrix] = {}
    for name, shape in layer_shapes(args, layer).items():
        if name.endswith("norm.weight"):
            weights[name] = torch.ones(shape, dtype=dtype, device=device)
        elif quant is not None and len(shape) == 2 and shape[1] % quant.group_size == 0 and \
                not name.endswith(".gate.weight"):  # a router stays float, as converters leave it
            weights[name] = random_groups(shape, quant, rng)
        else:
            weights[name] = random_tensor(shape, generator).to(device=device, dtype=half if half and len(shape) == 2
                                                                else dtype)
    with torch.device("meta"):
        model = ShardModel(args, layer, 1, False, False)
    installer = Installer(dtype, device, int4_kernel_available(device),
                          native_kernels(device) if quant is not None or half is not None else None,
                          gpu=quant is not None and triton_available(device))
    if args.mla is not None:  # the per-head projections, as the engine loads them
        weights = per_head_matrices(split_kv_b(weights, args), args, installer.forms, device, dtype)
    if half is not None:
        weights = hold_half(weights)
    state = fuse_checkpoint_weights(weights, args, False, False)
    installer.install(model, state)
    load_state(model, state)
    model.requires_grad_(False).eval().prepare()
    prefill_item, decode_item, n_blocks = measure_items()
    pool = model.new_pool(n_blocks)
    pool.zero_()  # torch.empty: whatever the memory held (denormals would slow the attention down)

    def timed(item: WorkItem) -> Callable[[], None]:
        index = step_index([item], pool, args, device)
        x = (torch.randn(item.count, args.hidden_size, generator=generator) * WEIGHT_SCALE).to(device, dtype)

        def run() -> None:
            with torch.inference_mode():
                model(x, pool, index)
            synchronize(device)
        return run

    return LayerRunner(decode=timed(decode_item), prefill=timed(prefill_item))


def synchronize(device: torch.device) -> None:
    """Wait for the device: a step timed on an accelerator ends when its kernels do, not when they are queued."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    elif device.type == "mps":
        torch.mps.synchronize()
