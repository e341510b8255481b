"""GGUF files, llama.cpp's single-file format: a model's config, tokenizer and tensors, read with `gguf`.

A GGUF model is one file (or a split set `name-00001-of-00003.gguf`, ...): a header of metadata (architecture,
hyper-parameters, tokenizer, chat template) and tensor descriptions, then the tensors' bytes at offsets the
header gives. The header is parsed by gguf_header.py; a node then maps and reads only its own layers'
tensors, by offset.

Names and layouts are llama.cpp's: `blk.N.attn_q.weight` is `model.layers.N.self_attn.q_proj.weight`; a mixture's
experts are stacked per projection (`blk.N.ffn_gate_exps.weight`, [experts, out, in]) and are listed here as one
tensor per expert (`model.layers.N.mlp.experts.E.gate_proj.weight`, its own contiguous bytes of the stack); and for
the `llama` architecture llama.cpp's converter reorders the rows of the query and key projections (its rotary
embedding pairs neighbouring dimensions, Hugging Face's pairs the two halves of a head); they are put back here,
so a tensor read from a GGUF is the tensor the Hugging Face checkpoint holds, and the engines need no GGUF
knowledge. Quantized matrices come either dequantized to float32 (`gguf.quants`), the exact reference, or
as codes, scales and biases (gguf/blocks.py) for the engines' quantized kernels.
"""

from __future__ import annotations

import functools
import math
import re
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path

import numpy as np

from exo_like.errors import ModelNotFoundError, UnsupportedModelError
from exo_like.models.affine import AffineGroups
from exo_like.models.checkpoint import local_tensor_name
from exo_like.models.gguf import deepseek
from exo_like.models.gguf.metadata import ARCHITECTURES, CONFIG_TENSORS, ConfigFromMetadata
from exo_like.models.gguf.blocks import affine_groups, has_affine_form
from exo_like.models.shard import Shard
from exo_like.models.gguf.header import read_header

GGUF_SUFFIX = ".gguf"
# Gemma's norms scale by (1 + w); llama.cpp's converter stores them with the 1 added.
_NORMS_PLUS_ONE = ("gemma2", "gemma3")
# Tensor types read (and dequantized) here: what F32/F16/BF16 conversions and Q8_0, Q4_0, Q4_1, Q4_K_M, Q5_K_M,
# Q6_K and the like files contain, and gpt-oss's MXFP4 experts.
TENSOR_TYPES = ("F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q2_K", "Q3_K", "Q4_K", "Q5_K",
                "Q6_K", "MXFP4")
FLOAT_TYPES = ("F32", "F16", "BF16")
_SPLIT_NAME = re.compile(r"^(?P<stem>.+)-(?P<index>\d{5})-of-(?P<count>\d{5})\.gguf$")
_LAYER_TENSOR = re.compile(r"^blk\.(\d+)\.(.+)$")
_LAYER_NAMES = {
    "attn_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_q.bias": "self_attn.q_proj.bias",
    "attn_k.bias": "self_attn.k_proj.bias",
    "attn_v.bias": "self_attn.v_proj.bias",
    "attn_output.weight": "self_attn.o_proj.weight",
    "attn_output.bias": "self_attn.o_proj.bias",
    "attn_q_norm.weight": "self_attn.q_norm.weight",
    "attn_k_norm.weight": "self_attn.k_norm.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
    "ffn_gate_inp.weight": "mlp.gate.weight",
    "ffn_gate_inp_shexp.weight": "mlp.shared_expert_gate.weight",
    "ffn_gate_shexp.weight": "mlp.shared_expert.gate_proj.weight",
    "ffn_up_shexp.weight": "mlp.shared_expert.up_proj.weight",
    "ffn_down_shexp.weight": "mlp.shared_expert.down_proj.weight",
}
# Where an architecture names a layer's tensors otherwise: Phi-3 keeps q/k/v and gate/up fused, as its checkpoints do.
_GEMMA_NORMS = {
    "post_attention_norm.weight": "post_attention_layernorm.weight",
    "ffn_norm.weight": "pre_feedforward_layernorm.weight",  # Gemma's norm before the MLP
    "post_ffw_norm.weight": "post_feedforward_layernorm.weight",
}
_ARCH_LAYER_NAMES = {
    "phi3": {"attn_qkv.weight": "self_attn.qkv_proj.weight", "ffn_up.weight": "mlp.gate_up_proj.weight"},
    "gemma2": _GEMMA_NORMS,
    "gemma3": _GEMMA_NORMS,
    "gpt-oss": {"post_attention_norm.weight": "post_attention_layernorm.weight",
                "attn_sinks.weight": "self_attn.sinks", "ffn_gate_inp.bias": "mlp.gate.bias"},
    deepseek.ARCHITECTURE: deepseek.LAYER_NAMES,
}
# Stacked experts: GGUF tensor -> the projections it holds, in row order (llama.cpp's converter may fuse gate and
# up: `--fuse-gate-up-exps`); gpt-oss stacks the experts' biases too, [experts, out].
_EXPERT_STACKS = {
    f"{stack}.{kind}": projections for kind in ("weight", "bias") for stack, projections in (
        ("ffn_gate_exps", ("gate_proj",)), ("ffn_up_exps", ("up_proj",)), ("ffn_down_exps", ("down_proj",)),
        ("ffn_gate_up_exps", ("gate_proj", "up_proj")))
}
_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}


def is_gguf(path: Path) -> bool:
    return path.suffix == GGUF_SUFFIX and path.is_file()


def is_later_part(path: Path) -> bool:
    """A part of a split set other than its first (a model is named by its first part)."""
    match = _SPLIT_NAME.match(path.name)
    return match is not None and int(match["index"]) != 1


def find_gguf(path: Path) -> Path | None:
    """The GGUF file a path names: the file itself, or the one model in a folder (the first part of a split
    set); None if the path holds no GGUF. A folder with several models is an error naming them."""
    if is_gguf(path):
        return path
    if not path.is_dir():
        return None
    files = sorted(p for p in path.glob(f"*{GGUF_SUFFIX}") if p.is_file())
    models = [p for p in files if not is_later_part(p)]
    if len(models) > 1:
        raise ModelNotFoundError(f"{path} holds several GGUF models ({', '.join(p.name for p in models)}): "
                                 "name the file")
    return models[0] if models else None


def split_parts(first: Path) -> list[Path]:
    """Every file of a split GGUF model, in order (just `first` for a single file); missing parts are an error."""
    match = _SPLIT_NAME.match(first.name)
    if match is None:
        return [first]
    count = int(match["count"])
    parts = [first.with_name(f"{match['stem']}-{i:05d}-of-{count:05d}{GGUF_SUFFIX}") for i in range(1, count + 1)]
    missing = [p.name for p in parts if not p.is_file()]
    if missing:
        raise ModelNotFoundError(f"the split GGUF model {first.name} is missing {', '.join(missing)}")
    return parts


@dataclass(frozen=True)
class TensorEntry:
    """One tensor of the file, by its Hugging Face name, and where its bytes are."""

    gguf_name: str
    type_name: str
    shape: tuple[int, ...]  # rows first (numpy order), e.g. [out_features, in_features]
    n_bytes: int
    part: Path  # the file of a split set that holds it
    offset: int  # of its first byte in that file


def open_gguf(path: Path) -> "GGUFCheckpoint":
    """The checkpoint at `path`, parsed once per process while the file is unchanged: parsing a header with a
    large vocabulary takes seconds, and the registry and the engine both need it."""
    stat = path.stat()
    return _open_cached(path.absolute(), stat.st_mtime_ns, stat.st_size)


@functools.lru_cache(maxsize=4)
def _open_cached(path: Path, _mtime_ns: int, _size: int) -> "GGUFCheckpoint":
    return GGUFCheckpoint(path)


class GGUFCheckpoint(ConfigFromMetadata):
    """A GGUF model's metadata and tensor table (all parts of a split set). No file stays mapped: each read
    maps the tensor's own bytes and lets them go, so a node's memory ends at the tensors it copied."""

    def __init__(self, path: Path):
        from gguf import GGML_QUANT_SIZES, GGMLQuantizationType  # only nodes serving a GGUF model need gguf

        self.path = path
        self.parts = split_parts(path)
        self._stored: list[TensorEntry] = []  # every tensor, checked in `tensors`
        try:
            for index, part in enumerate(self.parts):
                header = read_header(part)
                if index == 0:
                    self.metadata = header.metadata
                for info in header.tensors:
                    kind = GGMLQuantizationType(info.type_id)
                    block_size, type_size = GGML_QUANT_SIZES[kind]
                    n_bytes = math.prod(info.dims) * type_size // block_size
                    self._stored.append(TensorEntry(info.name, kind.name, tuple(reversed(info.dims)), n_bytes, part,
                                                    header.data_start + info.offset))
        except (ValueError, OSError, IndexError, KeyError, TypeError) as exc:  # a truncated or foreign file
            raise UnsupportedModelError(f"{path.name} is not a readable GGUF file: {exc!r}") from None
        architecture = self.metadata.get("general.architecture")
        if architecture not in ARCHITECTURES:
            raise UnsupportedModelError(
                f"{path.name}: unsupported GGUF architecture {architecture!r}; supported: "
                f"{', '.join(ARCHITECTURES)}", code="unsupported_architecture")
        self.architecture = str(architecture)

    @cached_property
    def tensors(self) -> dict[str, TensorEntry]:
        """Hugging Face name -> entry, for every tensor the model uses (unknown extras are an error)."""
        entries = {}
        for entry in self._stored:
            if expert_stack(entry.gguf_name) is not None:
                self._check_type(entry)
                entries.update(expert_entries(entry))
                continue
            name = hf_tensor_name(entry.gguf_name, self.architecture)
            if name is None:
                raise UnsupportedModelError(f"{self.path.name}: tensor {entry.gguf_name!r} is not part of a "
                                            f"{self.architecture} model this project runs")
            self._check_type(entry)
            entries[name] = entry
        return entries

    def _check_type(self, entry: TensorEntry) -> None:
        if entry.type_name not in TENSOR_TYPES:
            raise UnsupportedModelError(
                f"{self.path.name}: tensor {entry.gguf_name} has type {entry.type_name}, which is not "
                f"supported; supported: {', '.join(TENSOR_TYPES)}", code="unsupported_quantization")

    def read(self, name: str, quantized: bool = False) -> np.ndarray | AffineGroups:
        """A tensor as the Hugging Face checkpoint holds it, in float32; with `quantized`, a matrix of a type
        that has an affine form (gguf/blocks.py) comes as its codes, scales and biases instead."""
        from gguf import GGMLQuantizationType
        from gguf.quants import dequantize

        entry = self.tensors[name]
        stored = np.memmap(entry.part, dtype=np.uint8, mode="r", offset=entry.offset, shape=(entry.n_bytes,))
        rows = int(np.prod(entry.shape[:-1]))  # a stack [n, out, in] (DeepSeek's per-head projections): n x out rows
        if len(entry.shape) > 1:  # one row of bytes per output row: the form gguf's dequantizers take
            stored = stored.reshape(rows, -1)
        values: np.ndarray | AffineGroups
        if quantized and len(entry.shape) in (2, 3) and has_affine_form(entry.type_name):
            values = affine_groups(entry.type_name, stored, (rows, entry.shape[-1]))
        else:
            values = dequantize(stored, GGMLQuantizationType[entry.type_name])
            # A copy: a float tensor comes back as a view of the memory map, which must not outlive the load.
            values = np.array(values, dtype=np.float32).reshape(entry.shape)
        if name.endswith(".shared_expert_gate.weight") and len(entry.shape) == 1:
            # One output row; llama-quantize stores it as a vector (the converter as [1, hidden]).
            return values.reshape(1, -1)
        if self.architecture in _NORMS_PLUS_ONE and name.endswith("norm.weight"):
            # (w + 1) - 1 is exact in float32 (Sterbenz), so the engines' 1 + w gives back the stored value.
            return values - np.float32(1)
        heads = {"q_proj": self.config_heads, "k_proj": self.config_kv_heads}.get(name.split(".")[-2])
        if self.architecture == "llama" and heads is not None:
            return _map_rows(values, lambda rows: unpermute_rotary_rows(rows, heads))
        return values

    @cached_property
    def config_heads(self) -> int:
        return int(self._key("attention.head_count"))

    @cached_property
    def config_kv_heads(self) -> int:
        return int(self._key("attention.head_count_kv", self.config_heads))

    @cached_property
    def quantized(self) -> bool:
        """Whether any matrix is stored in a quantized type."""
        return any(len(e.shape) == 2 and e.type_name not in FLOAT_TYPES for e in self.tensors.values())

    def read_shard(self, shard: Shard, tied: bool, quantized: bool = False
                   ) -> Iterator[tuple[str, np.ndarray | AffineGroups, str]]:
        """(shard-local name, tensor, stored type) of exactly the tensors `shard` needs (see `read` for
        `quantized`)."""
        for name, entry in self.tensors.items():
            local = local_tensor_name(name, shard, tied)
            if local is None:
                continue
            yield local, self.read(name, quantized), entry.type_name


def expert_stack(gguf_name: str) -> tuple[int, tuple[str, ...]] | None:
    """(layer, projections) of a stacked-experts tensor's name, else None."""
    match = _LAYER_TENSOR.match(gguf_name)
    if match is None or match.group(2) not in _EXPERT_STACKS:
        return None
    return int(match.group(1)), _EXPERT_STACKS[match.group(2)]


def expert_entries(entry: TensorEntry) -> dict[str, TensorEntry]:
    """One entry per expert and projection of a stack [experts, out, in] (biases: [experts, out]): each is `out`
    rows (of the stack's fused projections, an equal share of them) of contiguous bytes, so it reads as any
    matrix (or vector) does."""
    layer, projections = expert_stack(entry.gguf_name)
    kind = entry.gguf_name.rpartition(".")[2]
    if len(entry.shape) != (3 if kind == "weight" else 2):
        raise UnsupportedModelError(f"{entry.gguf_name}: experts must be stacked as [experts, out, in] (biases "
                                    f"[experts, out]), got shape {list(entry.shape)}")
    n_experts, rows, *inputs = entry.shape
    rows_each = rows // len(projections)
    row_bytes = entry.n_bytes // (n_experts * rows)
    entries = {}
    for expert in range(n_experts):
        for i, projection in enumerate(projections):
            offset = entry.offset + (expert * rows + i * rows_each) * row_bytes
            entries[f"model.layers.{layer}.mlp.experts.{expert}.{projection}.{kind}"] = TensorEntry(
                entry.gguf_name, entry.type_name, (rows_each, *inputs), rows_each * row_bytes, entry.part, offset)
    return entries


def _map_rows(values: np.ndarray | AffineGroups, reorder: Callable[[np.ndarray], np.ndarray]
              ) -> np.ndarray | AffineGroups:
    return values.map_rows(reorder) if isinstance(values, AffineGroups) else reorder(values)


def hf_tensor_name(gguf_name: str, architecture: str = "llama") -> str | None:
    match = _LAYER_TENSOR.match(gguf_name)
    if match:
        part = _ARCH_LAYER_NAMES.get(architecture, {}).get(match.group(2)) or _LAYER_NAMES.get(match.group(2))
        return None if part is None else f"model.layers.{match.group(1)}.{part}"
    if gguf_name in CONFIG_TENSORS:
        return gguf_name
    return _GLOBAL_NAMES.get(gguf_name)


def unpermute_rotary_rows(weight: np.ndarray, n_heads: int) -> np.ndarray:
    """Undo llama.cpp's converter, which orders each head's rows as pairs (0, d/2), (1, d/2+1), ... for its
    rotary embedding; Hugging Face's rotate-half wants the two halves of the head one after the other."""
    rows = weight.shape[0]
    half = rows // n_heads // 2
    return weight.reshape(n_heads, half, 2, *weight.shape[1:]).swapaxes(1, 2).reshape(weight.shape)
