"""How many bytes a model's layers take on a node: as stored, and as each engine holds them.

Read from tensor headers only (safetensors headers, local or from the hub; a GGUF file's tensor table), so a
node can plan a ring before any weight moves. A quantized checkpoint is held differently by each engine:
- an MLX node keeps MLX-format matrices as stored, and turns GGUF's affine types into MLX's packed form;
- a torch node on CPU keeps affine matrices packed for its native kernels (codes at their own width, see
  engines/torch/native/matrix.py), or where those could not be built in torch's int4 packs (two packs for 5 to 8
  bits; see engines/torch/int4.py); quantized matrices no kernel takes are dequantized to bfloat16, and float
  tensors are float32; on CUDA it holds the native form on the GPU (engines/torch/cuda/) beside bfloat16 float
  tensors; on other devices (MPS) it dequantizes to bfloat16;
- any node given a float --dtype dequantizes everything to that dtype (the reference path);
- GGUF types without an affine form (Q2_K, Q3_K, Q6_K) are dequantized by both engines.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from exo_like.models.checkpoint import local_tensor_name, safetensors_header, weight_map
from exo_like.models.gguf.blocks import BITS as GGUF_BITS
from exo_like.models.gguf.blocks import group_size as gguf_group_size
from exo_like.models.quantization import QUANTIZED_SUFFIXES, QuantSpec
from exo_like.models.shard import Shard

DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}
FLOAT_BYTES = {"F32": 4, "F16": 2, "BF16": 2, "F64": 8}
QUANTIZED_FLOAT_BYTES = 2  # float tensors of a quantized model on MLX's quantized path: bfloat16
TORCH_CPU_FLOAT_BYTES = 4  # and on torch's CPU path, where activations are float32
TORCH_CPU_DEQUANTIZED_BYTES = 2  # quantized matrices without a kernel there: bfloat16
INT4_GROUP_SIZES = (32, 64, 128, 256)
MLX_BITS = (2, 3, 4, 5, 6, 8)
MLX_GROUP_SIZES = (32, 64, 128)  # MLX's quantized matmul's (GGUF's Q6_K groups of 16 are dequantized there)
MXFP4_BLOCKS, MXFP4_SCALES = "_blocks", "_scales"  # the Hub's MXFP4 tensors (gpt-oss experts)
_FUSED = {"q_proj": "qkv", "k_proj": "qkv", "v_proj": "qkv", "gate_proj": "gate_up", "up_proj": "gate_up"}


def int4_refusal(bits: int, group_size: int, outputs: int) -> str | None:
    """Why torch's int4 CPU kernel cannot hold a matrix (None if it can)."""
    if bits > 8:
        return f"{bits}-bit codes"
    if group_size not in INT4_GROUP_SIZES:
        return f"groups of {group_size}"
    if outputs % 16:
        return f"{outputs} outputs (not a multiple of 16)"
    return None


@dataclass(frozen=True)
class Matrix:
    """One tensor of the checkpoint as the footprint sees it. bits/group_size: 0 for a float tensor; bits 0 with
    `quantized` for a quantized type that has no affine form."""

    name: str  # Hugging Face name, e.g. model.layers.3.mlp.up_proj.weight
    shape: tuple[int, ...]  # logical [out, in] for a matrix
    stored_bytes: int  # with its scales and biases for an MLX-format matrix
    float_bytes: int  # itemsize of a float tensor as stored (0 for a quantized one)
    bits: int = 0
    group_size: int = 0
    quantized: bool = False
    mlx_format: bool = False
    native_form: str = ""  # how the native kernels hold it (see native_form)

    @property
    def numel(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return n

    @property
    def affine(self) -> bool:
        return self.bits > 0

    def fusion_key(self) -> str | None:
        """The torch engine's fused projection this matrix joins (per layer), if any."""
        parts = self.name.split(".")
        if len(parts) > 3 and parts[-1] == "weight" and parts[-2] in _FUSED:
            # Per module: an attention, an MLP, each expert of a mixture, a shared expert.
            return ".".join(parts[:-2] + [_FUSED[parts[-2]]])
        return None


# How the native kernels keep each type's scales (and biases): 16-bit numbers ("half"), or as K-quants store them,
# a byte a group and a float32 a super-block of 256 values ("k"); symmetric types (bias = -zero * scale) keep no
# biases.
HALF_SYMMETRIC = frozenset({"Q4_0", "Q5_0", "Q8_0", "MXFP4", "mxfp4"})
HALF = frozenset({"Q4_1", "Q5_1"})
K_FORMS = {"Q4_K": "k", "Q5_K": "k", "Q6_K": "k-symmetric"}
K_SUPER = 256  # values per K-quant super-block


def native_form(source: str, bits: int) -> str:
    """How the native kernels hold a matrix of this type (AffineGroups.source: a GGUF type, "mlx N-bit",
    "mxfp4"): "half-symmetric", "half", "k", "k-symmetric", or "" (not at all)."""
    if source in HALF_SYMMETRIC:
        return "half-symmetric"
    if source in HALF or source == f"mlx {bits}-bit":
        return "half"
    return K_FORMS.get(source, "")


def stacked_form(forms: list[str]) -> str:
    """The native form of matrices stacked into one (q, k, v): the parts' if they share it, else "half" for 16-bit
    parts of which some keep biases, else none (a stack keeps one form of scales)."""
    kinds = set(forms)
    if len(kinds) == 1:
        return forms[0]
    return "half" if kinds <= {"half", "half-symmetric"} else ""


def native_refusal(bits: int, group_size: int, inputs: int, form: str) -> str | None:
    """Why the torch engine's native CPU kernels cannot hold a matrix (None if they can)."""
    if not form:
        return "scales not 16-bit numbers"
    if bits > 8:
        return f"{bits}-bit codes"
    if inputs % 32:
        return f"{inputs} inputs (not a multiple of 32)"
    if group_size & (group_size - 1) or group_size < 16 or (group_size == 16 and bits > 6):
        return f"groups of {group_size} with {bits}-bit codes"
    return None


def native_bytes(bits: int, group_size: int, out: int, inputs: int, form: str) -> int:
    """Bytes of a matrix packed for the native kernels: 4, 6 or 8 bits a code; a 16-bit scale (and bias) a group,
    or for K-quants a byte (and a byte) a group and a float32 (and another) a super-block."""
    code_bits = 4 if bits <= 4 else 6 if bits <= 6 else 8
    codes = out * inputs * code_bits // 8
    factors = 1 if form.endswith("symmetric") else 2  # scales, and biases unless symmetric
    if form.startswith("k"):
        return codes + factors * out * (inputs // group_size + 4 * (inputs // K_SUPER))
    return codes + factors * out * (inputs // group_size) * 2


def int4_bytes(bits: int, group_size: int, out: int, inputs: int) -> int:
    packs = 1 if bits <= 4 else 2
    return packs * (out * inputs // 2 + (inputs // group_size) * out * 2 * 2)


def torch_cpu_bytes(matrices: list[Matrix], native: bool, cuda: bool = False) -> int:
    """Bytes of the torch engine's quantized path (CPU: native kernels, or torch's int4 packs; `cuda`: the GPU
    kernels, which hold the native kernels' form, beside bfloat16 float tensors), fused projections taken together
    as it stacks them."""
    total = 0
    fused: dict[str, list[Matrix]] = {}
    for m in matrices:
        key = m.fusion_key() if m.quantized else None
        if key is None:
            total += _torch_piece_bytes([m], native, cuda)
        else:
            fused.setdefault(key, []).append(m)
    for group in fused.values():
        first = group[0]
        if all(m.affine and (m.bits, m.group_size, m.shape[1]) == (first.bits, first.group_size, first.shape[1])
               for m in group):
            total += _torch_piece_bytes(group, native, cuda)
        else:
            total += sum(_torch_piece_bytes([m], native, cuda) for m in group)
    return total


# A quantized kv_b_proj (DeepSeek's, in MLX-format checkpoints and older GGUF files): the torch engine holds its
# key rows dequantized, as float32 (latent attention multiplies by their transpose, see engines/torch/mla.py), and
# its value rows quantized; counted here all as float32, a little over (the header does not tell the two apart).
# GGUF's attn_k_b / attn_v_b are per-head stacks [heads, out, in], held quantized as any matrix.
LATENT_PROJECTIONS = (".kv_b_proj.weight",)
PER_HEAD_STACKS = (".embed_q.weight", ".unembed_out.weight")


def _torch_piece_bytes(stacked: list[Matrix], native: bool, cuda: bool = False) -> int:
    first = stacked[0]
    float_bytes = QUANTIZED_FLOAT_BYTES if cuda else TORCH_CPU_FLOAT_BYTES
    if first.name.endswith(LATENT_PROJECTIONS):
        return sum(m.numel * float_bytes for m in stacked)
    out = sum(m.shape[0] for m in stacked)
    form = stacked_form([m.native_form for m in stacked])
    if native and first.affine and native_refusal(first.bits, first.group_size, first.shape[1], form) is None:
        return native_bytes(first.bits, first.group_size, out, first.shape[1], form)
    if not cuda and first.affine and int4_refusal(first.bits, first.group_size, out) is None:
        return int4_bytes(first.bits, first.group_size, out, first.shape[1])
    return sum(m.numel * (TORCH_CPU_DEQUANTIZED_BYTES if m.quantized else float_bytes) for m in stacked)


def mlx_quantized_bytes(m: Matrix) -> int:
    """Bytes of a GGUF matrix on MLX's quantized path (packed codes, bfloat16 scales and biases)."""
    if m.affine and m.bits in MLX_BITS and m.group_size in MLX_GROUP_SIZES:
        groups = m.numel // m.group_size
        return m.numel * m.bits // 8 + 2 * groups * QUANTIZED_FLOAT_BYTES
    return m.numel * QUANTIZED_FLOAT_BYTES


@dataclass(frozen=True)
class ModelFootprint:
    """Parameter bytes of a checkpoint: per layer, plus embedding and head.

    For a quantized checkpoint, `unpacked` is the same checkpoint dequantized to floats of `stored_dtype_bytes`
    (what a node given a --dtype holds), and `quantized` what each engine's quantized path holds, by holding
    ("torch-cpu", "mlx"). MLX keeps an MLX-format checkpoint quantized whatever its dtype (`mlx_native`)."""

    layer_bytes: tuple[int, ...]
    embed_bytes: int
    head_bytes: int  # final norm + LM head (0 extra for the head when embeddings are tied)
    tied: bool
    stored_dtype_bytes: int
    unpacked: "ModelFootprint | None" = None
    quantized: "tuple[tuple[str, ModelFootprint], ...]" = ()
    mlx_native: bool = False

    def shard_bytes(self, shard: Shard) -> int:
        """A tensor-parallel rank's share of the layers is counted as 1/size of them (it also holds its copies of
        the norms, routers and, when ranks outnumber KV heads, of its KV heads: a few per cent more)."""
        total = sum(self.layer_bytes[shard.start_layer:shard.end_layer])
        if shard.tp is not None:
            total = -(-total // shard.tp.size)
        if shard.is_first:
            total += self.embed_bytes
        if shard.is_last:
            total += self.head_bytes + (self.embed_bytes if self.tied and not shard.is_first else 0)
        return total

    def held_by(self, engine: str | None, dtype: str | None = None, device: str | None = None,
                native: bool = True) -> "ModelFootprint":
        """The bytes a node running `engine` on `device` holds, given its --dtype (None: the default); `native`:
        whether a torch CPU node has its native kernels (a node without a compiler runs torch's int4 packs).
        Planning assumes every CPU node has them (built at install); the difference is small either way."""
        if self.unpacked is None:  # a float checkpoint: cast to the dtype
            return self if dtype is None else self._in_dtype(DTYPE_BYTES.get(dtype, self.stored_dtype_bytes))
        quantized = dict(self.quantized)
        if engine == "mlx" and (dtype is None or self.mlx_native):
            return quantized.get("mlx", self)
        if dtype is not None:
            return self.unpacked._in_dtype(DTYPE_BYTES.get(dtype, self.unpacked.stored_dtype_bytes))
        if engine == "torch":
            on_cpu = device is None or device.startswith("cpu")
            key = ("torch-cpu" if native else "torch-cpu-int4") if on_cpu else \
                "torch-cuda" if device.startswith("cuda") else None
            return quantized[key] if key in quantized else self.unpacked._in_dtype(QUANTIZED_FLOAT_BYTES)
        return self

    def _in_dtype(self, itemsize: int) -> "ModelFootprint":
        def scale(n: int) -> int:
            return n * itemsize // self.stored_dtype_bytes

        return ModelFootprint(tuple(scale(n) for n in self.layer_bytes), scale(self.embed_bytes),
                              scale(self.head_bytes), self.tied, itemsize)

    def to_json(self) -> dict[str, Any]:
        return {"layer_bytes": list(self.layer_bytes), "embed_bytes": self.embed_bytes,
                "head_bytes": self.head_bytes, "tied": self.tied, "stored_dtype_bytes": self.stored_dtype_bytes,
                "unpacked": self.unpacked.to_json() if self.unpacked is not None else None,
                "quantized": {k: v.to_json() for k, v in self.quantized}, "mlx_native": self.mlx_native}

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> "ModelFootprint":
        unpacked = data.get("unpacked")  # absent in manifests saved before it was recorded
        quantized = tuple((k, cls.from_json(v)) for k, v in (data.get("quantized") or {}).items())
        return cls(tuple(int(n) for n in data["layer_bytes"]), int(data["embed_bytes"]), int(data["head_bytes"]),
                   bool(data["tied"]), int(data["stored_dtype_bytes"]),
                   cls.from_json(unpacked) if unpacked else None, quantized, bool(data.get("mlx_native", False)))


@dataclass(frozen=True)
class ModelDescription:
    """What planning needs about a model: its layer count and bytes; and what the cluster view shows of it."""

    n_layers: int
    footprint: ModelFootprint
    architecture: str | None = None  # the config's model_type
    parameters: dict[str, int] | None = None  # {"total", "active"}: see parameters.py
    tensor_sizes: tuple[int, ...] = ()  # tensor-parallel group sizes the layers split over (tensor_split.py)
    tensor_engines: tuple[str, ...] = ("torch", "mlx")  # the engines whose nodes can form such groups


def model_footprint(model_dir: Path, n_layers: int, tied: bool, quant: QuantSpec | None = None) -> ModelFootprint:
    """Read sizes from the safetensors headers (no tensor data is read)."""
    files = sorted(set(weight_map(model_dir).values()))
    tensors = ((name, entry["dtype"], entry["data_offsets"][1] - entry["data_offsets"][0], tuple(entry["shape"]))
               for file in files for name, entry in safetensors_header(model_dir / file).items())
    return footprint_from_tensors(tensors, n_layers, tied, quant)


def safetensors_matrices(tensors: Iterable[tuple[str, str, int, tuple[int, ...]]],
                         quant: QuantSpec | None) -> list[Matrix]:
    """(name, safetensors dtype, bytes, shape) -> Matrices; an MLX-format triple (packed weight, scales, biases)
    becomes one, and so do the Hub's MXFP4 blocks and scales."""
    listed = {name: (dtype, size, tuple(shape)) for name, dtype, size, shape in tensors}
    matrices = []
    for name, (dtype, size, shape) in listed.items():
        if name.endswith(QUANTIZED_SUFFIXES) or (name.endswith(MXFP4_SCALES) and name.replace(
                MXFP4_SCALES, MXFP4_BLOCKS) in listed):
            continue
        prefix = name.removesuffix(".weight")
        if name.endswith(MXFP4_BLOCKS) and name.replace(MXFP4_BLOCKS, MXFP4_SCALES) in listed:
            matrices += _mxfp4_experts(name, shape, size + listed[name.replace(MXFP4_BLOCKS, MXFP4_SCALES)][1])
        elif quant is not None and dtype == "U32" and f"{prefix}.scales" in listed:
            spec = quant.for_module(prefix)
            extra = sum(listed[f"{prefix}{s}"][1] for s in QUANTIZED_SUFFIXES if f"{prefix}{s}" in listed)
            logical = (*shape[:-1], shape[-1] * 32 // spec.bits)
            if name.endswith(PER_HEAD_STACKS):  # (mlx-lm's DeepSeek conversions) as its heads' matrices, stacked
                logical = (logical[0] * logical[1], logical[2])
            bits = 5 if spec.mxfp4 else spec.bits  # torch holds MXFP4 as exact 5-bit groups (affine.mxfp4_affine)
            sixteen_bit = listed[f"{prefix}.scales"][0] in ("BF16", "F16")
            form = "half-symmetric" if spec.mxfp4 else "half" if sixteen_bit else ""
            matrices += _per_expert(Matrix(name, logical, size + extra, 0, bits, spec.group_size, True, True, form))
        else:
            matrices += _per_expert(Matrix(name, shape, size, FLOAT_BYTES.get(dtype, 2)))
    return matrices


def _mxfp4_experts(name: str, shape: tuple[int, ...], stored: int) -> list[Matrix]:
    """The Hub's gpt-oss experts `...mlp.experts.gate_up_proj_blocks` [experts, out, in / 32, 16] as the engines
    hold them: per expert its gate and up (rows interleaved in the stack) and down matrices, 5-bit on torch."""
    module, _, leaf = name.removesuffix(MXFP4_BLOCKS).rpartition(".")
    experts, rows, groups = shape[:3]
    projections = ("gate_proj", "up_proj") if leaf == "gate_up_proj" else ("down_proj",)
    each = stored // (experts * len(projections))
    return [Matrix(f"{module}.{e}.{p}.weight", (rows // len(projections), groups * 32), each, 0, 5, 32, True, True,
                   "half-symmetric") for e in range(experts) for p in projections]


def _per_expert(m: Matrix) -> list[Matrix]:
    """An MLX-format mixture's experts are stacked ([experts, out, in] under `switch_mlp`, or under `experts` for
    gpt-oss); the engines that hold them one by one (torch) size each on its own, under the per-expert names the
    fusions follow."""
    stack = next((marker for marker in (".switch_mlp.", ".experts.") if marker in m.name), None)
    if len(m.shape) != 3 or stack is None:
        return [m]
    module, _, projection = m.name.removesuffix(".weight").rpartition(stack)
    experts = m.shape[0]
    return [replace(m, name=f"{module}.experts.{e}.{projection}.weight", shape=m.shape[1:],
                    stored_bytes=m.stored_bytes // experts) for e in range(experts)]


def gguf_matrices(entries: Iterable[tuple[str, str, int, tuple[int, ...]]]) -> list[Matrix]:
    """(name, GGUF type, bytes, shape) -> Matrices."""
    matrices = []
    for name, type_name, size, shape in entries:
        if name.endswith(PER_HEAD_STACKS):  # as its heads' matrices, stacked along their outputs
            shape = (shape[0] * shape[1], shape[2])
        if type_name in FLOAT_BYTES:
            matrices.append(Matrix(name, shape, size, FLOAT_BYTES[type_name]))
        else:
            bits = GGUF_BITS.get(type_name, 0)
            matrices.append(Matrix(name, shape, size, 0, bits, gguf_group_size(type_name) if bits else 0,
                                   quantized=True, native_form=native_form(type_name, bits)))
    return matrices


def footprint_from_tensors(tensors: Iterable[tuple[str, str, int, tuple[int, ...]]], n_layers: int, tied: bool,
                           quant: QuantSpec | None = None) -> ModelFootprint:
    """The footprint of a safetensors checkpoint from its tensors' (name, dtype, stored bytes, shape).

    Works from headers read locally or fetched from the hub, so a node can plan before it downloads.
    quant: the checkpoint's MLX quantization (see quantization.py), if it has one."""
    return footprint_from_matrices(safetensors_matrices(tensors, quant), n_layers, tied)


def footprint_from_matrices(matrices: list[Matrix], n_layers: int, tied: bool) -> ModelFootprint:
    whole = Shard("footprint", 0, n_layers, n_layers)
    kept = [m for m in matrices if local_tensor_name(m.name, whole, tied) is not None]
    float_bytes = max((m.float_bytes for m in kept if m.float_bytes and len(m.shape) == 2), default=0) or \
        max((m.float_bytes for m in kept), default=2)
    stored = _sum_by_part(((m.name, m.stored_bytes) for m in kept), n_layers, tied, float_bytes)
    if not any(m.quantized for m in kept):
        return stored
    if not any(m.float_bytes and len(m.shape) == 2 for m in kept):
        float_bytes = QUANTIZED_FLOAT_BYTES  # every matrix quantized: the dequantized form is bfloat16
    unpacked = _sum_by_part(((m.name, m.numel * float_bytes) for m in kept), n_layers, tied, float_bytes)
    mlx_native = any(m.mlx_format for m in kept)
    mlx = stored if mlx_native else _sum_by_part(
        ((m.name, mlx_quantized_bytes(m) if m.quantized else m.numel * QUANTIZED_FLOAT_BYTES) for m in kept),
        n_layers, tied, float_bytes)
    torch_cpu = _sum_torch(kept, n_layers, tied, float_bytes, True)
    torch_int4 = _sum_torch(kept, n_layers, tied, float_bytes, False)
    torch_cuda = _sum_torch(kept, n_layers, tied, float_bytes, True, cuda=True)
    return replace(stored, unpacked=unpacked,
                   quantized=(("mlx", mlx), ("torch-cpu", torch_cpu), ("torch-cpu-int4", torch_int4),
                              ("torch-cuda", torch_cuda)),
                   mlx_native=mlx_native)


def _sum_torch(kept: list[Matrix], n_layers: int, tied: bool, float_bytes: int, native: bool, cuda: bool = False
               ) -> ModelFootprint:
    by_part: dict[str, list[Matrix]] = {}
    for m in kept:
        by_part.setdefault(_part(m.name), []).append(m)
    sizes = [(group[0].name, torch_cpu_bytes(group, native, cuda)) for group in by_part.values()]
    return _sum_by_part(sizes, n_layers, tied, float_bytes)


def _part(name: str) -> str:
    if name.startswith("model.layers."):
        return ".".join(name.split(".")[:3])
    return "embed" if name.startswith("model.embed_tokens.") else "head"


def _sum_by_part(sizes: Iterable[tuple[str, int]], n_layers: int, tied: bool, float_bytes: int) -> ModelFootprint:
    layers = [0] * n_layers
    embed = head = 0
    for name, size in sizes:
        if name.startswith("model.layers."):
            layers[int(name.split(".")[2])] += size
        elif name.startswith("model.embed_tokens."):
            embed += size
        else:
            head += size
    return ModelFootprint(tuple(layers), embed, head, tied, float_bytes)
