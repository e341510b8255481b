"""The MLX engine: one shard of a Llama-family model on Apple Silicon (Metal) or on CPU.

Reads only the safetensors files that hold the shard's tensors and keeps only those tensors (`mx.load` maps a
file lazily, so tensors that are never touched are never read). Keys and values of every request on this stage
live in one pool of KV blocks per layer.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

import mlx.core as mx
import mlx.nn as nn
import numpy as np
from mlx.utils import tree_flatten

from exo_like.engines.activations import Activations
from exo_like.engines.base import (Engine, EngineUnavailableError, WeightForms, check_cancel, free_replaced_shard,
                                   return_freed_memory)
from exo_like.engines.layer_speed import LayerRunner
from exo_like.engines.mlx.layer import layer_runner
from exo_like.engines.mlx.attention import LayerPool, StepIndex, step_index
from exo_like.engines.mlx.mlp import stack_experts, stacked_name
from exo_like.engines.mlx.ranks import rank_tensors
from exo_like.engines.mlx.model import Reduce, ShardModel, split_fused_projections, split_module_paths
from exo_like.engines.work import BLOCK_SIZE, KVPoolSize, WorkItem
from exo_like.errors import InvalidRequestError, UnsupportedModelError
from exo_like.models.affine import AffineGroups, pack_words
from exo_like.models.checkpoint import ShardLoadPlan, plan_shard_load
from exo_like.models.config import DTYPES, ModelArgs
from exo_like.models.footprint import MLX_BITS, MLX_GROUP_SIZES
from exo_like.models.gguf.file import FLOAT_TYPES, is_gguf, open_gguf
from exo_like.models.families.deepseek import EMBED_Q, KEY_ROWS, PER_HEAD
from exo_like.models.quantization import QuantSpec
from exo_like.models.shard import Shard
from exo_like.models.tensor_split import GGUF_GROUP, rank_args, split_align

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


def read_shard_tensors(model_dir: Path, args: ModelArgs, shard: Shard, quantized: bool,
                       forms: WeightForms) -> tuple[dict[str, mx.array], dict[str, dict[str, int]]]:
    """The shard's tensors under their shard-local names, from a GGUF file or a Hugging Face folder, and the
    quantization settings (nn.quantize's {group_size, bits[, mode]}) of each matrix kept quantized (`quantized`: a
    GGUF file's, in MLX's packed form; an MLX-format checkpoint's always), by module path. `forms` counts the GGUF
    matrices kept quantized and those dequantized for want of a kernel."""
    tied_embeddings = args.tie_word_embeddings
    if not is_gguf(model_dir):
        plan = plan_shard_load(model_dir, shard, tied_embeddings, args.family.rename)
        weights = as_words(args.family.converted(read_plan_tensors(plan, tied_embeddings), args))
        specs = mlx_format_specs(args, weights, {local: name for names in plan.files.values() for name, local in names})
        specs = {split: spec for path, spec in specs.items() for split in split_module_paths(path)}
        return per_head_arrays(split_fused_projections(stack_experts(weights), args), specs, args), specs
    weights, specs = {}, {}
    for local, value, type_name in open_gguf(model_dir).read_shard(shard, tied_embeddings, quantized):
        if isinstance(value, AffineGroups) and value.bits in MLX_BITS and value.group_size in MLX_GROUP_SIZES:
            prefix = local.removesuffix(".weight")
            weights[local] = mx.array(pack_words(value.codes, value.bits))
            weights[f"{prefix}.scales"], weights[f"{prefix}.biases"] = mx.array(value.scales), mx.array(value.biases)
            specs[prefix] = {"group_size": value.group_size, "bits": value.bits}
            forms.add_quantized(type_name)
            continue
        if isinstance(value, AffineGroups):
            forms.add_dequantized(f"{type_name} ({value.bits}-bit codes)" if value.bits not in MLX_BITS else
                                  f"{type_name} (groups of {value.group_size})")
            value = value.dequantize()
        elif quantized and type_name not in FLOAT_TYPES:
            forms.add_dequantized(f"{type_name} (no affine form)")
        weights[local] = mx.array(value)
    # Experts of one projection share the stack's type (one GGUF tensor), so their specs are the stack's.
    specs = {(stacked_name(path) or (path,))[0]: spec for path, spec in specs.items()}
    # A fused matrix (Phi-3's qkv_proj, gate_up_proj) splits into projections of its own type.
    specs = {split: spec for path, spec in specs.items() for split in split_module_paths(path)}
    return per_head_arrays(split_fused_projections(stack_experts(args.family.converted(weights, args)), args), specs,
                           args), specs


def per_head_arrays(weights: dict[str, mx.array], specs: dict[str, dict[str, Any]], args: ModelArgs
                    ) -> dict[str, mx.array]:
    """Latent attention's per-head projections (families/deepseek.py) as mla.PerHead holds them, [heads, out, in]
    (a quantized one's packed words, scales and biases alike); a quantized kv_b_proj's key rows become embed_q as
    stored, its transpose, which QuantizedPerHead multiplies so (`transposed` in its settings). Updates `specs`."""
    if args.mla is None:
        return weights
    heads = args.num_attention_heads
    for name in [n for n in weights if n.rpartition(".")[0].rpartition(".")[2] in PER_HEAD]:
        array = weights.pop(name)
        stored, _, leaf = name.rpartition(".")
        module = stored.removesuffix(KEY_ROWS) + EMBED_Q if stored.endswith(f".{KEY_ROWS}") else stored
        if module != stored and stored in specs:  # (once per module: its first leaf moves its settings)
            specs[module] = {**specs.pop(stored), "transposed": True}
        weights[f"{module}.{leaf}"] = array.reshape(heads, -1, array.shape[-1]) if array.ndim == 2 else array
    return weights


def mlx_format_specs(args: ModelArgs, weights: dict[str, mx.array], stored: dict[str, str]
                     ) -> dict[str, dict[str, int | str]]:
    """Each quantized matrix's settings, by module path: as mlx-lm does, a layer is quantized exactly when the
    checkpoint has its `.scales` (converters leave some in float), with the config's settings for its module as
    the checkpoint names it (`stored`: local tensor name -> checkpoint name; mixed precision, e.g. 8-bit routers,
    is keyed by those names, which a family may rename)."""
    if args.quant is None:
        return {}
    return {name.removesuffix(".scales"): args.quant.for_module(stored.get(name, name).removesuffix(".scales"))
            .mlx_settings() for name in weights if name.endswith(".scales")}


def as_words(weights: dict[str, mx.array]) -> dict[str, mx.array]:
    """Quantized weights given as packed bytes (the Hub's MXFP4 blocks) as the uint32 words MLX's kernels take."""
    for name, array in weights.items():
        if array.dtype == mx.uint8 and name.endswith(".weight") and f"{name.removesuffix('.weight')}.scales" in weights:
            weights[name] = mx.view(mx.contiguous(array), mx.uint32)
    return weights


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
        self._pools: list[LayerPool] = []
        self._kv_size: KVPoolSize | None = None

    # ---- loading -------------------------------------------------------------------------------------------

    def unload(self) -> None:
        self._model, self._pools, self._kv_size = None, [], None
        super().unload()
        mx.clear_cache()  # MLX keeps freed buffers for reuse: they go back to the system

    def load(self, model_dir: Path, args: ModelArgs, shard: Shard, cancel: threading.Event | None = None) -> None:
        if shard.n_layers != args.num_hidden_layers:
            raise ValueError(f"shard {shard} does not match the model's {args.num_hidden_layers} layers")
        started = time.perf_counter()
        dtype_name = self.requested_dtype or _checkpoint_dtype(args)
        self._model, self._pools, self.shard, self.args = None, [], None, None
        free_replaced_shard()
        mx.clear_cache()  # MLX keeps freed buffers for reuse: the old shard's go back to the system
        self.weight_forms = WeightForms()
        if shard.tp is not None:  # row-parallel splits fall on the checkpoint's quantization groups
            shard = replace(shard, tp=replace(shard.tp, align=self._split_align(Path(model_dir), args)))
        with mx.stream(self._device):
            model = ShardModel(args if shard.tp is None else rank_args(args, shard.tp), shard,
                               None if shard.tp is None else self._group_reduce(shard))
            # A float --dtype asks for a GGUF file's dequantized (reference) path; an MLX-format checkpoint
            # stays quantized (its reference, mlx-lm, runs it so).
            forms = WeightForms()
            weights, specs = read_shard_tensors(Path(model_dir), args, shard, self.requested_dtype is None, forms)
            if shard.tp is not None:
                weights = rank_tensors(weights, specs, args, shard.tp)
            # Quantized layers swapped in where the checkpoint stores quantized matrices, before loading them.
            nn.quantize(model, class_predicate=lambda path, _: specs.get(path, False))
            if args.quant is not None:
                for name in (n for n in weights if n.endswith(".scales")):
                    spec = specs[name.removesuffix(".scales")]
                    forms.add_quantized("mlx mxfp4" if spec.get("mode") == "mxfp4" else f"mlx {spec['bits']}-bit")
            dtype = MX_DTYPES[dtype_name]
            model.load_weights([(name, _cast(w, dtype)) for name, w in weights.items()], strict=True)
            # Read everything now, so the first request does not pay for loading and the files can be closed;
            # a few tensors at a time, so that a cancelled load stops soon.
            parameters = [array for _, array in tree_flatten(model.parameters())]
            for start in range(0, len(parameters), EVAL_GROUP):
                check_cancel(cancel)
                mx.eval(parameters[start:start + EVAL_GROUP])
            del parameters
        return_freed_memory()
        self._model, self._dtype_name = model, dtype_name
        self.shard, self.args, self.weight_forms = shard, args, forms
        if forms.dequantized:
            log.warning("%s: no quantized kernel for %s: dequantized to %s", shard, forms.describe_dequantized(),
                        dtype_name)
        log.info(
            "loaded %s on %s as %s: %d tensors from %s, %.1f MB in %.2fs",
            shard, self.device_name, dtype_name, len(weights), Path(model_dir).name,
            self.parameter_bytes() / 1e6, time.perf_counter() - started,
        )

    def _split_align(self, model_dir: Path, args: ModelArgs) -> int:
        if args.quant is not None:
            return split_align(args.quant.group_size)
        quantized = self.requested_dtype is None and is_gguf(model_dir) and open_gguf(model_dir).quantized
        return split_align(GGUF_GROUP) if quantized else 1

    def _group_reduce(self, shard: Shard) -> Reduce:
        group = self.group
        if group is None or shard.tp is None or (group.rank, group.size) != (shard.tp.rank, shard.tp.size):
            raise ValueError(f"{shard} needs this engine to be rank {shard.tp} of a tensor-parallel group")
        return group.all_reduce

    # ---- measuring (placement by speed) -------------------------------------------------------------------

    def layer_form(self, model_dir: Path, args: ModelArgs) -> str:
        quant = self._measured_quant(model_dir, args)
        dtype = self.requested_dtype or _checkpoint_dtype(args)
        return dtype if quant is None else f"{dtype}, {quant.bits}-bit groups of {quant.group_size}"

    def layer_runner(self, model_dir: Path, args: ModelArgs) -> LayerRunner:
        dtype = MX_DTYPES[self.requested_dtype or _checkpoint_dtype(args)]
        return layer_runner(args, self._device, dtype, self._measured_quant(model_dir, args))

    def _measured_quant(self, model_dir: Path, args: ModelArgs) -> QuantSpec | None:
        """An MLX-format checkpoint runs quantized always; a GGUF file's affine types unless a --dtype asks for
        the dequantized path (as load does), measured as 4-bit groups of 32, their most common form."""
        if args.quant is not None:
            return args.quant
        if self.requested_dtype is None and is_gguf(model_dir) and open_gguf(model_dir).quantized:
            return QuantSpec(group_size=32, bits=4)
        return None

    # ---- running -------------------------------------------------------------------------------------------

    def step(self, items: Sequence[WorkItem], inputs: np.ndarray | Activations) -> Activations | np.ndarray:
        model, index = self._require_model(), self._step_index(items)
        with mx.stream(self._device):
            h = model.embed(self._to_mlx(inputs, index.layout.rows))
            if self.group is not None:  # the leader of a tensor-parallel group: its followers run the step too
                self.group.share_step(items, self._to_activations(h))
            out = model.head(model.run_layers(h, self._pools, index), index)
            mx.eval(out, [pool.state for pool in self._pools])
            return np.array(out.astype(mx.float32)) if model.shard.is_last else self._to_activations(out)

    def follow(self, items: Sequence[WorkItem], hidden: Activations) -> None:
        model, index = self._require_model(), self._step_index(items)
        with mx.stream(self._device):
            h = model.run_layers(self._to_mlx(hidden, index.layout.rows), self._pools, index)
            mx.eval(h, [pool.state for pool in self._pools])

    def _step_index(self, items: Sequence[WorkItem]) -> StepIndex:
        size = self._kv_size
        if not self._pools or size is None:
            raise RuntimeError("no KV pool: call allocate_kv() after load()")
        return step_index(items, size.blocks, size.window_blocks, self._require_model().args)

    def kv_block_bytes(self) -> tuple[int, int]:
        model = self._require_model()
        args, shard = model.args, model.shard  # a tensor-parallel rank's pools hold its own KV heads only
        heads, key_width, value_width = args.kv_layout()
        per_layer = heads * BLOCK_SIZE * (key_width + value_width) * MX_DTYPES[self._dtype_name].size
        windowed = sum(args.window(layer) is not None for layer in range(shard.start_layer, shard.end_layer))
        return (shard.end_layer - shard.start_layer - windowed) * per_layer, windowed * per_layer

    def allocate_kv(self, n_blocks: int, n_window_blocks: int | None = None) -> None:
        self._pools, self._kv_size = [], None  # the old pool's memory goes before the new one is taken
        window_blocks = n_blocks if n_window_blocks is None else n_window_blocks
        with mx.stream(self._device):
            self._pools = self._require_model().make_pools(n_blocks, window_blocks, MX_DTYPES[self._dtype_name])
            mx.eval([pool.state for pool in self._pools])
        self._kv_size = KVPoolSize(n_blocks, window_blocks if self.kv_block_bytes()[1] else None)
        self._log_pool(self._kv_size)

    @property
    def kv_size(self) -> KVPoolSize | None:
        return self._kv_size if self._pools else None

    def close(self) -> None:
        # A thread that ran MLX holds per-thread state (its streams, and the random key layer initialisation
        # used) whose destructors take the GIL; left to the thread's exit, they can run while the interpreter
        # finalizes, and the process aborts. MLX asks each such thread to clear them itself before it ends.
        self._model, self._pools, self._kv_size, self.shard, self.args = None, [], None, None, None
        mx.clear_streams()

    def _to_mlx(self, inputs: np.ndarray | Activations, rows: int) -> mx.array:
        """Token ids -> int32 [R]; activations -> engine dtype [R, H]."""
        shard, args = self.shard, self.args
        if shard.is_first:
            if isinstance(inputs, Activations) or inputs.shape != (rows,) or not np.issubdtype(inputs.dtype,
                                                                                             np.integer):
                raise InvalidRequestError(f"the first shard takes the batch's {rows} token ids, got "
                                          f"{_describe(inputs)}")
            # MLX does not bounds-check gathers: an out-of-range id would read arbitrary memory.
            if inputs.min() < 0 or inputs.max() >= args.vocab_size:
                raise InvalidRequestError(f"token ids must lie in [0, {args.vocab_size})")
            return mx.array(inputs.astype(np.int32))
        if not isinstance(inputs, Activations) or tuple(inputs.shape) != (rows, args.hidden_size):
            raise InvalidRequestError(
                f"shard {shard} takes activations [{rows}, {args.hidden_size}], got {_describe(inputs)}"
            )
        x = mx.array(inputs.bits())
        if inputs.dtype == "bfloat16":
            x = x.view(mx.bfloat16)  # the wire carries bfloat16 as its uint16 bit pattern
        return x.astype(MX_DTYPES[self._dtype_name])

    def _to_activations(self, hidden: mx.array) -> Activations:
        if hidden.dtype == mx.bfloat16:
            bits = np.array(hidden.view(mx.uint16))
        else:
            bits = np.array(hidden)
        return Activations(dtype=self._dtype_name, shape=tuple(hidden.shape), data=bits.tobytes())

    def _require_model(self) -> ShardModel:
        if self._model is None:
            raise RuntimeError("MLXEngine.forward called before load")
        return self._model

    # ---- bookkeeping ---------------------------------------------------------------------------------------

    def parameter_bytes(self) -> int:
        if self._model is None:
            return 0
        return sum(array.nbytes for _, array in tree_flatten(self._model.parameters()))

    @property
    def device_name(self) -> str:
        return describe_device(self._device)

    @property
    def on_cpu(self) -> bool:
        return self._device.type == mx.cpu

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
