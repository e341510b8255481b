"""The MLX engine: one shard of a Llama-family model on Apple Silicon (Metal) or on CPU.

Reads only the safetensors files that hold the shard's tensors and keeps only those tensors (`mx.load` maps a
file lazily, so tensors that are never touched are never read). One KV cache per request id.
"""

from __future__ import annotations

import logging
import threading
import time
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
import numpy as np
from mlx.utils import tree_flatten

from exo_like.activations import Activations
from exo_like.checkpoint import ShardLoadPlan, plan_shard_load
from exo_like.engines.base import Engine, EngineUnavailableError, check_cancel
from exo_like.engines.mlx_model import KVCache, ShardModel
from exo_like.errors import InvalidRequestError, UnsupportedModelError
from exo_like.model_config import DTYPES, ModelArgs
from exo_like.shard import Shard

log = logging.getLogger(__name__)

EVAL_GROUP = 16  # tensors read per step of a load: a cancelled load stops after at most this many

MX_DTYPES: dict[str, mx.Dtype] = {"float32": mx.float32, "bfloat16": mx.bfloat16, "float16": mx.float16}


def resolve_device(requested: str | None) -> mx.Device:
    """None/'auto' -> MLX's default (the GPU on Apple Silicon); 'cpu'; 'gpu'/'metal' if a GPU exists."""
    if requested in (None, "", "auto"):
        return mx.default_device()
    if requested == "cpu":
        return mx.Device(mx.cpu)
    if requested in ("gpu", "metal"):
        if not mx.is_available(mx.gpu):
            raise EngineUnavailableError("MLX has no GPU on this machine (this MLX build runs on CPU only)")
        return mx.Device(mx.gpu)
    raise EngineUnavailableError(f"unknown MLX device {requested!r}; choose auto, cpu or gpu")


def describe_device(device: mx.Device) -> str:
    if device.type == mx.cpu:
        return "mlx cpu"
    try:
        return f"mlx gpu ({mx.device_info()['device_name']})"
    except (KeyError, RuntimeError):
        return "mlx gpu"


def read_plan_tensors(plan: ShardLoadPlan, tied_embeddings: bool) -> dict[str, mx.array]:
    """The plan's tensors under their shard-local names, from the plan's files only (still lazy)."""
    weights: dict[str, mx.array] = {}
    for path, names in plan.files.items():
        file_arrays = mx.load(str(path))
        for checkpoint_name, local_name in names:
            if _is_derived(local_name, tied_embeddings):
                continue
            weights[local_name] = file_arrays[checkpoint_name]
        # Dropping the dict drops the references to tensors outside the plan, which were never read.
        del file_arrays
    return weights


def _is_derived(name: str, tied_embeddings: bool) -> bool:
    """Tensors some checkpoints carry that the model recomputes or shares instead of loading."""
    if name.endswith("rotary_emb.inv_freq"):
        return True
    return tied_embeddings and name.startswith("lm_head.")


def quantize_like_checkpoint(model: ShardModel, args: ModelArgs, weights: dict[str, mx.array]) -> None:
    """Swap in quantized layers where the checkpoint stores quantized matrices, before loading them.

    As mlx-lm does, a layer is quantized exactly when the checkpoint has its `.scales`: converters leave some
    layers in float (e.g. ones whose input size is not a multiple of the group size)."""
    spec = args.quant
    if spec is None:
        return
    nn.quantize(model, spec.group_size, spec.bits, class_predicate=lambda path, _: f"{path}.scales" in weights)


def _cast(array: mx.array, dtype: mx.Dtype) -> mx.array:
    """Floating tensors take the engine's dtype; packed quantized weights (uint32) stay as stored."""
    return array.astype(dtype) if mx.issubdtype(array.dtype, mx.floating) else array


class MLXEngine(Engine):
    name = "mlx"

    def __init__(self, device: str | None = None, dtype: str | None = None):
        super().__init__(device=device, dtype=dtype)
        if dtype is not None and dtype not in DTYPES:
            raise ValueError(f"unsupported dtype {dtype!r}; choose one of {', '.join(DTYPES)}")
        self._device = resolve_device(device)
        self._dtype_name = dtype or "float32"
        self._model: ShardModel | None = None
        self._caches: dict[str, list[KVCache]] = {}

    # ---- loading -------------------------------------------------------------------------------------------

    def load(self, model_dir: Path, args: ModelArgs, shard: Shard, cancel: threading.Event | None = None) -> None:
        if shard.n_layers != args.num_hidden_layers:
            raise ValueError(f"shard {shard} does not match the model's {args.num_hidden_layers} layers")
        started = time.perf_counter()
        dtype_name = self.requested_dtype or _checkpoint_dtype(args)
        self._model, self._caches, self.shard, self.args = None, {}, None, None
        plan = plan_shard_load(Path(model_dir), shard, args.tie_word_embeddings)
        with mx.stream(self._device):
            model = ShardModel(args, shard)
            weights = read_plan_tensors(plan, args.tie_word_embeddings)
            quantize_like_checkpoint(model, args, weights)
            dtype = MX_DTYPES[dtype_name]
            model.load_weights([(name, _cast(w, dtype)) for name, w in weights.items()], strict=True)
            # Read everything now, so the first request does not pay for loading and the files can be closed;
            # a few tensors at a time, so that a cancelled load stops soon.
            parameters = [array for _, array in tree_flatten(model.parameters())]
            for start in range(0, len(parameters), EVAL_GROUP):
                check_cancel(cancel)
                mx.eval(parameters[start:start + EVAL_GROUP])
            del parameters
        self._model, self._dtype_name = model, dtype_name
        self.shard, self.args = shard, args
        log.info(
            "loaded %s on %s as %s: %d tensors from %d files, %.1f MB in %.2fs",
            shard, self.device_name, dtype_name, len(weights), len(plan.files),
            self.parameter_bytes() / 1e6, time.perf_counter() - started,
        )

    # ---- running -------------------------------------------------------------------------------------------

    def forward(self, request_id: str, inputs: np.ndarray | Activations) -> Activations | np.ndarray:
        model = self._require_model()
        cache = self._caches.get(request_id) or model.make_cache()
        with mx.stream(self._device):
            x = self._to_mlx(inputs)
            self._check_context(cache, x.shape[1])
            out = model(x, cache)
            mx.eval(out, [c.state for c in cache])
            result = np.array(out[0, -1].astype(mx.float32)) if model.shard.is_last else self._to_activations(out[0])
        # Only a completed step is remembered: a failed first call leaves no half-made cache behind.
        self._caches[request_id] = cache
        return result

    def _to_mlx(self, inputs: np.ndarray | Activations) -> mx.array:
        """Token ids -> int32 [1, T]; activations -> engine dtype [1, T, H]."""
        shard, args = self.shard, self.args
        if shard.is_first:
            if isinstance(inputs, Activations) or inputs.ndim != 1 or not np.issubdtype(inputs.dtype, np.integer):
                raise InvalidRequestError(f"the first shard takes a 1-D array of token ids, got {_describe(inputs)}")
            if inputs.size == 0:
                raise InvalidRequestError("no tokens to run")
            # MLX does not bounds-check gathers: an out-of-range id would read arbitrary memory.
            if inputs.min() < 0 or inputs.max() >= args.vocab_size:
                raise InvalidRequestError(f"token ids must lie in [0, {args.vocab_size})")
            return mx.array(inputs.astype(np.int32))[None]
        if not isinstance(inputs, Activations) or len(inputs.shape) != 2 or inputs.shape[1] != args.hidden_size:
            raise InvalidRequestError(
                f"shard {shard} takes activations [T, {args.hidden_size}], got {_describe(inputs)}"
            )
        x = mx.array(inputs.bits())
        if inputs.dtype == "bfloat16":
            x = x.view(mx.bfloat16)  # the wire carries bfloat16 as its uint16 bit pattern
        return x.astype(MX_DTYPES[self._dtype_name])[None]

    def _to_activations(self, hidden: mx.array) -> Activations:
        if hidden.dtype == mx.bfloat16:
            bits = np.array(hidden.view(mx.uint16))
        else:
            bits = np.array(hidden)
        return Activations(dtype=self._dtype_name, shape=tuple(hidden.shape), data=bits.tobytes())

    def _check_context(self, cache: list[KVCache], new_positions: int) -> None:
        total = cache[0].offset + new_positions if cache else new_positions
        if total > self.args.context_length:
            raise InvalidRequestError(
                f"{total} positions exceed the model's context length of {self.args.context_length}",
                code="context_length_exceeded",
            )

    def _require_model(self) -> ShardModel:
        if self._model is None:
            raise RuntimeError("MLXEngine.forward called before load")
        return self._model

    # ---- bookkeeping ---------------------------------------------------------------------------------------

    def release(self, request_id: str) -> None:
        self._caches.pop(request_id, None)

    def cached_length(self, request_id: str) -> int:
        cache = self._caches.get(request_id)
        return cache[0].offset if cache else 0

    def parameter_bytes(self) -> int:
        if self._model is None:
            return 0
        return sum(array.nbytes for _, array in tree_flatten(self._model.parameters()))

    @property
    def device_name(self) -> str:
        return describe_device(self._device)

    @property
    def dtype_name(self) -> str:
        return self._dtype_name


def _checkpoint_dtype(args: ModelArgs) -> str:
    if args.torch_dtype not in MX_DTYPES:
        raise UnsupportedModelError(f"checkpoint dtype {args.torch_dtype!r} is not supported by the MLX engine")
    return args.torch_dtype


def _describe(inputs: object) -> str:
    if isinstance(inputs, Activations):
        return f"activations {inputs.dtype} {list(inputs.shape)}"
    if isinstance(inputs, np.ndarray):
        return f"array {inputs.dtype} {list(inputs.shape)}"
    return type(inputs).__name__


ENGINE_CLASS = MLXEngine
