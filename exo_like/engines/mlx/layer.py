"""One random layer of a model's shape on the MLX engine (its own initialisation, quantized as a load would), and
the two steps layer_speed.py times."""

from __future__ import annotations

from collections.abc import Callable

import mlx.core as mx
import mlx.nn as nn

from exo_like.engines.layer_speed import LayerRunner, measure_items, measured_layer
from exo_like.engines.mlx.attention import LayerPool, step_index
from exo_like.engines.mlx.model import TransformerBlock
from exo_like.engines.work import WorkItem
from exo_like.models.config import ModelArgs
from exo_like.models.quantization import QuantSpec


def layer_runner(args: ModelArgs, device: mx.Device, dtype: mx.Dtype, quant: QuantSpec | None) -> LayerRunner:
    args, layer_index = measured_layer(args)
    with mx.stream(device):
        layer = TransformerBlock(args, layer_index)  # MLX initialises its layers with random weights
        if quant is not None:
            nn.quantize(layer, quant.group_size, quant.bits)
        layer.set_dtype(dtype)  # floating parameters only: packed codes stay as they are
        mx.eval(layer.parameters())
        prefill_item, decode_item, n_blocks = measure_items()
        pool = LayerPool(args, n_blocks, dtype)
        mx.eval(pool.state)

    def timed(item: WorkItem) -> Callable[[], None]:
        index = step_index([item], n_blocks, n_blocks if args.kv_window else None, args)
        with mx.stream(device):
            x = (mx.random.normal((item.count, args.hidden_size)) * 0.02).astype(dtype)
            mx.eval(x)

        def run() -> None:
            with mx.stream(device):
                mx.eval(layer(x, pool, index), pool.state)
        return run

    return LayerRunner(decode=timed(decode_item), prefill=timed(prefill_item))
