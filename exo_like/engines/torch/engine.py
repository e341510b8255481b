"""The PyTorch engine: one shard of a Llama-family model on CUDA, MPS or CPU, with a pool of KV blocks.

Calls are serialised by the node (see engines/base.py). A bfloat16 CPU decode step briefly switches PyTorch's
process-wide oneDNN flag off (linear.native_matvec); that, too, relies on torch not being used by
another thread of this process at the same moment.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import replace
from pathlib import Path

import numpy as np
import torch

from exo_like.engines.activations import Activations
from exo_like.engines.base import Engine, WeightForms, check_cancel, free_replaced_shard, return_freed_memory
from exo_like.engines.layer_speed import LayerRunner
from exo_like.engines.torch.layer import layer_runner
from exo_like.engines.torch.loading import checkpoint_skips, hold_half, read_planned_tensors
from exo_like.engines.torch.attention import KVPool, step_index
from exo_like.engines.torch.linear import bound_onednn_caches
from exo_like.engines.torch.model import ShardModel, fuse_checkpoint_weights, load_state
from exo_like.engines.torch.openmp import pin_openmp_team
from exo_like.engines.torch.cuda.graphs import DecodeGraphs
from exo_like.engines.torch.cuda.graphs import refusal as graphs_refusal
from exo_like.engines.torch.cuda.matrix import triton_available
from exo_like.engines.torch.mla import per_head_matrices
from exo_like.engines.torch.install import Installer, cpu_numerics
from exo_like.engines.torch.int4 import int4_kernel_available
from exo_like.engines.torch.quant import Matrix, native_kernels
from exo_like.engines.work import KVPoolSize, WorkItem
from exo_like.errors import InvalidRequestError
from exo_like.models.affine import AffineGroups
from exo_like.models.checkpoint import plan_shard_load
from exo_like.models.config import DTYPES, ModelArgs
from exo_like.models.gguf.file import FLOAT_TYPES, is_gguf, open_gguf
from exo_like.models.quantization import QuantSpec
from exo_like.models.shard import Shard
from exo_like.models.tensor_split import GGUF_GROUP, rank_args, split_align, split_tensor, unfused

log = logging.getLogger(__name__)

_GGUF_HALF = {"BF16": torch.bfloat16, "F16": torch.float16}  # a GGUF file's 16-bit types (read as float32: exact)

# How a layer of a quantized GGUF file is measured: its K-quant matrices mostly run as 4-bit affine groups of 32.
GGUF_MEASURED_QUANT = QuantSpec(group_size=32, bits=4)

TORCH_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
DTYPE_NAMES = {dtype: name for name, dtype in TORCH_DTYPES.items()}


def pick_device(requested: str | None) -> torch.device:
    """CUDA if available, else MPS, else CPU, unless a device is requested."""
    if requested:
        return torch.device(requested)
    if torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    if torch.backends.mps.is_available():
        return torch.device("mps")
    return torch.device("cpu")


def pick_dtype(requested: str | None, checkpoint_dtype: str, device: torch.device, quantized: bool = False
               ) -> torch.dtype:
    """The requested dtype, else the checkpoint's; a float16 checkpoint runs as bfloat16 on CPU. Quantized
    weights run with float32 activations on CPU, only the kernel's inputs rounded to bfloat16 (bfloat16
    activations throughout were no faster and agreed less often with the float32 reference; see
    test_smollm2_quantized_kernels_agree_with_the_dequantized_path), and bfloat16 elsewhere."""
    if requested:
        return TORCH_DTYPES[requested]
    if quantized:
        return torch.float32 if device.type == "cpu" else torch.bfloat16
    name = checkpoint_dtype if checkpoint_dtype in TORCH_DTYPES else "float32"
    if name == "float16" and device.type == "cpu":
        # CPU float16 matmuls are far slower than bfloat16 ones; bfloat16 keeps the same memory footprint.
        log.info("checkpoint dtype float16 runs as bfloat16 on cpu (cpu float16 kernels are slow)")
        name = "bfloat16"
    return TORCH_DTYPES[name]


def half_storage(requested: str | None, checkpoint_dtype: str, device: torch.device) -> torch.dtype | None:
    """The 16-bit dtype a bfloat16 or float16 checkpoint's matrices stay in on CPU, beside float32 activations
    (the native kernels widen each weight as they read it, half.cpp); None where this does not apply (a --dtype
    named, another device, another checkpoint dtype, no native kernels). Why: a CPU without bfloat16 arithmetic
    emulates it, and a bfloat16 node there prefilled at a sixth of float32's rate (AVX2: 90 against 559 tok/s);
    widened, a prompt runs at float32's rate and a decode step reads half float32's bytes. float16 weights stay
    float16, exactly, instead of being rounded to bfloat16."""
    if requested is not None or device.type != "cpu" or native_kernels(device) is None:
        return None
    return TORCH_DTYPES.get(checkpoint_dtype) if checkpoint_dtype in ("bfloat16", "float16") else None


def activations_to_tensor(activations: Activations, device: torch.device, dtype: torch.dtype) -> torch.Tensor:
    bits = np.array(activations.bits())  # copy: the payload is read-only bytes
    if activations.dtype == "bfloat16":
        tensor = torch.from_numpy(bits.view(np.int16)).view(torch.bfloat16)
    else:
        tensor = torch.from_numpy(bits)
    return tensor.to(device=device, dtype=dtype)


def tensor_to_activations(tensor: torch.Tensor) -> Activations:
    tensor = tensor.detach().contiguous().cpu()
    name = DTYPE_NAMES[tensor.dtype]
    if tensor.dtype == torch.bfloat16:
        # numpy has no bfloat16: ship the 16-bit patterns.
        tensor = tensor.view(torch.int16)
    return Activations(dtype=name, shape=tuple(tensor.shape), data=tensor.numpy().tobytes())


class TorchEngine(Engine):
    name = "torch"

    def __init__(self, device: str | None = None, dtype: str | None = None):
        super().__init__(device=device, dtype=dtype)
        bound_onednn_caches()
        self.device = pick_device(device)
        if dtype is not None and dtype not in TORCH_DTYPES:
            raise ValueError(f"unsupported dtype {dtype!r}; choose one of {', '.join(DTYPES)}")
        self.dtype: torch.dtype = TORCH_DTYPES[dtype or "float32"]  # until load() reads the checkpoint's
        self.model: ShardModel | None = None
        self.half: torch.dtype | None = None  # the matrices' 16-bit dtype beside float32 activations (half_storage)
        self.pool: KVPool | None = None
        self.graphs: DecodeGraphs | None = None  # CUDA: decode steps as graphs, over the pool
        self._threads_placed = False
        # Probed on the engine thread, at the first load: a parallel region run on any other thread (cpu_numerics
        # packs probe weights) leaves a second OpenMP team alive, more threads than cores, and libgomp then stops
        # spinning between the engine's regions (measured: the node's decode step 15 -> 25 ms).
        self._numerics: dict[str, str] | None = None

    def unload(self) -> None:
        self.model, self.pool, self.graphs = None, None, None
        super().unload()

    def load(self, model_dir: Path, args: ModelArgs, shard: Shard, cancel: threading.Event | None = None) -> None:
        if shard.n_layers != args.num_hidden_layers:
            raise ValueError(f"shard {shard} does not match the model's {args.num_hidden_layers} layers")
        self.model, self.shard, self.args, self.pool, self.graphs = None, None, None, None, None
        free_replaced_shard()
        first_load = self._numerics is None
        if first_load:
            self._numerics = cpu_numerics() if self.device.type == "cpu" else {}
        self.weight_forms = WeightForms()
        started = time.perf_counter()
        keep_quantized = self._keeps_quantized(model_dir, args)
        half = None if keep_quantized or shard.tp is not None else \
            half_storage(self.requested_dtype, args.torch_dtype, self.device)
        self.half = half
        self.dtype = torch.float32 if half else pick_dtype(self.requested_dtype, args.torch_dtype, self.device,
                                                           keep_quantized)
        log.info("loading %s from %s on %s as %s%s", shard, Path(model_dir).name, self.device, DTYPE_NAMES[self.dtype],
                 f" ({DTYPE_NAMES[half]} matrices, widened on the native kernels)" if half else "")
        if shard.tp is not None:
            # Row-parallel splits fall on the checkpoint's quantization groups, the same on every rank
            shard = replace(shard, tp=replace(shard.tp, align=self._split_align(model_dir, args)))
        held_args = args if shard.tp is None else rank_args(args, shard.tp)
        with torch.device("meta"):  # no memory, no random init: every parameter is replaced by a loaded tensor
            model = ShardModel(held_args, shard.start_layer, shard.layer_count, shard.is_first, shard.is_last,
                               None if shard.tp is None else self._group_reduce(shard))
        installer = Installer(self.dtype, self.device, int4_kernel_available(self.device),
                              native_kernels(self.device) if keep_quantized or half else None,
                              gpu=keep_quantized and triton_available(self.device))
        weights = self._read_weights(Path(model_dir), args, shard, keep_quantized, installer, cancel, half)
        if shard.tp is not None:
            weights = {name: split_tensor(name, tensor, args, shard.tp)
                       for name, tensor in unfused(weights, args).items()}
        state = fuse_checkpoint_weights(weights, held_args, shard.is_first, shard.is_last)
        installer.install(model, state)
        load_state(model, state)
        # Drop our references so prepare()'s relayout frees each old tensor as it goes.
        del weights, state
        model.requires_grad_(False).eval().prepare()
        self.model, self.shard, self.args = model, shard, args
        self.weight_forms = installer.forms
        if installer.forms.dequantized:
            log.warning("%s: no quantized kernel for %s: dequantized to %s", shard,
                        installer.forms.describe_dequantized(), DTYPE_NAMES[installer.dense_dtype])
        return_freed_memory()
        log.info("loaded %s: %.1f MB in %.2fs", shard, self.parameter_bytes() / 1e6, time.perf_counter() - started)
        if first_load and self._numerics:
            # These paths make results differ, slightly, between CPUs: say which ones run, once, as they first do.
            log.info("cpu numerics: %s", ", ".join(f"{k} {v}" for k, v in self._numerics.items()))

    def _group_reduce(self, shard: Shard) -> Callable[[torch.Tensor], torch.Tensor]:
        group = self.group
        if group is None or shard.tp is None or (group.rank, group.size) != (shard.tp.rank, shard.tp.size):
            raise ValueError(f"{shard} needs this engine to be rank {shard.tp} of a tensor-parallel group")
        return group.all_reduce

    @staticmethod
    def _split_align(model_dir: Path, args: ModelArgs) -> int:
        if args.quant is not None:
            return split_align(args.quant.group_size)
        return split_align(GGUF_GROUP) if is_gguf(model_dir) and open_gguf(model_dir).quantized else 1

    def _keeps_quantized(self, model_dir: Path, args: ModelArgs) -> bool:
        """A quantized checkpoint runs on quantized kernels unless a float --dtype asks for the dequantized
        (reference) path."""
        if self.requested_dtype is not None:
            return False
        return args.quant is not None or (is_gguf(model_dir) and open_gguf(model_dir).quantized)

    def layer_form(self, model_dir: Path, args: ModelArgs) -> str:
        quant = self._measured_quant(model_dir, args)
        half = self._half(args, quant)
        dtype = DTYPE_NAMES[pick_dtype(self.requested_dtype, args.torch_dtype, self.device, quant is not None)]
        if half is not None:
            return f"float32 activations, {DTYPE_NAMES[half]} matrices"
        return dtype if quant is None else f"{dtype} activations, {quant.bits}-bit groups of {quant.group_size}"

    def layer_runner(self, model_dir: Path, args: ModelArgs) -> LayerRunner:
        quant = self._measured_quant(model_dir, args)
        half = self._half(args, quant)
        dtype = torch.float32 if half else pick_dtype(self.requested_dtype, args.torch_dtype, self.device,
                                                      quant is not None)
        return layer_runner(args, self.device, dtype, quant, half)

    def _half(self, args: ModelArgs, quant: QuantSpec | None) -> torch.dtype | None:
        return None if quant is not None else half_storage(self.requested_dtype, args.torch_dtype, self.device)

    def _measured_quant(self, model_dir: Path, args: ModelArgs) -> QuantSpec | None:
        if not self._keeps_quantized(model_dir, args):
            return None
        return args.quant or GGUF_MEASURED_QUANT

    def _read_weights(self, model_dir: Path, args: ModelArgs, shard: Shard, keep: bool, installer: Installer,
                      cancel: threading.Event | None, half: torch.dtype | None = None) -> dict[str, Matrix]:
        weights = self._read_stored(model_dir, args, shard, keep, installer, cancel, half)
        return per_head_matrices(weights, args, installer.forms, installer.device, self.dtype) if args.mla is not None else weights

    def _read_stored(self, model_dir: Path, args: ModelArgs, shard: Shard, keep: bool, installer: Installer,
                     cancel: threading.Event | None, half: torch.dtype | None) -> dict[str, Matrix]:
        if is_gguf(model_dir):
            weights: dict[str, Matrix] = {}
            for local, value, type_name in open_gguf(model_dir).read_shard(shard, args.tie_word_embeddings, keep):
                check_cancel(cancel)
                if isinstance(value, AffineGroups):
                    weights[local] = value
                elif keep and type_name not in FLOAT_TYPES:
                    weights[local] = installer.dense(value, f"{type_name} (no affine form)")
                else:
                    kept = _GGUF_HALF.get(type_name) if half and value.ndim == 2 else None
                    weights[local] = torch.from_numpy(value).to(device=self.device, dtype=kept or self.dtype)
            weights = args.family.converted(weights, args)
            return hold_half(weights) if half else weights
        plan = plan_shard_load(model_dir, shard, args.tie_word_embeddings, args.family.rename)
        skip = checkpoint_skips(plan, args.tie_word_embeddings)
        return read_planned_tensors(plan, skip, self.device, self.dtype, args.quant, cancel, keep,
                                    lambda weights: args.family.converted(weights, args), half is not None)

    def step(self, items: Sequence[WorkItem], inputs: np.ndarray | Activations) -> Activations | np.ndarray:
        model, pool = self._loaded_model(), self._pool()
        index = step_index(items, pool, model.args, self.device)
        x = self._input_tensor(inputs, index.layout.rows)
        if self.graphs is not None and self.graphs.bucket_for(index.layout) is not None:
            with torch.inference_mode():
                out = self.graphs.run(index.layout, x)
                return out.float().cpu().numpy() if model.is_last else tensor_to_activations(out.clone())
        with torch.inference_mode():
            h = model.embed(x)
            if self.group is not None:  # the leader of a tensor-parallel group: its followers run the step too
                self.group.share_step(items, tensor_to_activations(h))
            out = model.head(model.run_layers(h, pool, index), index)
            if model.is_last:
                return out.float().cpu().numpy()
            return tensor_to_activations(out)

    def follow(self, items: Sequence[WorkItem], hidden: Activations) -> None:
        model, pool = self._loaded_model(), self._pool()
        index = step_index(items, pool, model.args, self.device)
        with torch.inference_mode():
            model.run_layers(activations_to_tensor(hidden, self.device, self.dtype), pool, index)

    def kv_block_bytes(self) -> tuple[int, int]:
        model = self._loaded_model()
        return KVPool.block_bytes(model.args, model.layer_ids, self.dtype)

    def allocate_kv(self, n_blocks: int, n_window_blocks: int | None = None) -> None:
        self.pool, self.graphs = None, None  # the old pool's memory goes before the new one is taken
        model = self._loaded_model()
        graphs = self.device.type == "cuda" and graphs_refusal(model) is None
        self.pool = model.new_pool(n_blocks, n_window_blocks, spare=1 if graphs else 0)
        if graphs:  # decode steps as CUDA graphs (cuda/graphs.py), over this pool
            self.graphs = DecodeGraphs(model, self.pool, capture=True)
        elif self.device.type == "cuda":
            log.info("%s: decode steps launch their kernels one by one: %s", self.shard, graphs_refusal(model))
        self._log_pool(self.kv_size)

    @property
    def kv_size(self) -> KVPoolSize | None:
        return None if self.pool is None else KVPoolSize(self.pool.n_blocks, self.pool.n_window_blocks)

    def place_threads(self) -> None:
        """On CPU, one core per OpenMP thread of this (the engine) thread's team: see engines/torch/openmp.py."""
        if self.device.type != "cpu" or self._threads_placed:
            return
        self._threads_placed = True
        cpus = pin_openmp_team(torch.get_num_threads())
        if cpus is not None:
            log.info("pinned %d torch threads to cpus %s", len(cpus), ",".join(map(str, cpus)))

    def parameter_bytes(self) -> int:
        if self.model is None:
            return 0
        return sum(t.numel() * t.element_size() for t in self.model.held_tensors())

    @property
    def device_name(self) -> str:
        if self.device.type == "cuda":
            return f"{self.device} ({torch.cuda.get_device_name(self.device)})"
        return str(self.device)

    @property
    def on_cpu(self) -> bool:
        return self.device.type == "cpu"

    @property
    def dtype_name(self) -> str:
        return DTYPE_NAMES[self.dtype]

    def numerics(self) -> dict[str, str]:
        return dict(self._numerics or {})

    def _loaded_model(self) -> ShardModel:
        if self.model is None:
            raise RuntimeError("no shard loaded: call load() first")
        return self.model

    def _pool(self) -> KVPool:
        if self.pool is None:
            raise RuntimeError("no KV pool: call allocate_kv() after load()")
        return self.pool

    def _input_tensor(self, inputs: np.ndarray | Activations, rows: int) -> torch.Tensor:
        """Token ids [R] on the first shard, hidden states [R, H] (any wire dtype) on the others."""
        if self.model.is_first:
            ids = np.asarray(inputs)
            if isinstance(inputs, Activations) or ids.shape != (rows,) or ids.dtype.kind not in "iu":
                raise InvalidRequestError(f"the first shard takes the batch's {rows} integer token ids")
            if ids.min() < 0 or ids.max() >= self.args.vocab_size:
                raise InvalidRequestError(f"token ids must lie in [0, {self.args.vocab_size})")
            return torch.from_numpy(ids.astype(np.int64)).to(self.device)
        if not isinstance(inputs, Activations):
            raise InvalidRequestError("a shard after the first takes hidden states as Activations")
        if tuple(inputs.shape) != (rows, self.args.hidden_size):
            raise InvalidRequestError(f"hidden states must be [{rows}, {self.args.hidden_size}], "
                                      f"got {list(inputs.shape)}")
        return activations_to_tensor(inputs, self.device, self.dtype)


ENGINE_CLASS = TorchEngine
