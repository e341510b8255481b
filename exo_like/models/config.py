"""ModelArgs: the one parsed view of a Hugging Face `config.json` that both engines build their model from.

The fields every family shares are read here; each family (models/families/) adds its own (attention biases,
query/key norms, a mixture of experts) and refuses what it does not know. Reads rope
settings from both conventions: the Hub's `rope_theta` + `rope_scaling`, and transformers >= 5's
`rope_parameters` (which carries `rope_theta` inside it). A GGUF file's config (gguf/metadata.py) may add
`rope_freq_factors`: llama.cpp's per-dimension divisors of the rotary frequencies (its `rope_freqs` tensor, how
its converter stores Llama 3.1's llama3 rope scaling).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import numpy as np

from exo_like.errors import UnsupportedModelError
from exo_like.models.families import Family, MlaArgs, MoeArgs, family_for
from exo_like.models.quantization import QuantSpec, quant_spec
from exo_like.models.rope import attention_factor, rope_settings, rotary_fraction, scaled_inv_freq

DTYPES = ("float32", "bfloat16", "float16")


@dataclass(frozen=True)
class ModelArgs:
    model_type: str
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: dict[str, Any] | None
    max_position_embeddings: int
    tie_word_embeddings: bool
    torch_dtype: str
    qkv_bias: bool = False
    o_bias: bool = False
    mlp_bias: bool = False
    qk_norm: bool = False
    eos_token_ids: tuple[int, ...] = ()
    bos_token_id: int | None = None
    quantization: dict[str, Any] | None = field(default=None)
    # llama.cpp's `rope_freqs`: each rotary frequency is divided by its factor (head_dim // 2 of them).
    rope_freq_factors: tuple[float, ...] | None = None
    moe: MoeArgs | None = None  # the mixture of experts of a MoE family (which layers, how many experts)
    # Gemma's differences from Llama, each a plain setting the engines' shared blocks take:
    hidden_act: str = "silu"  # the MLP's gate activation: silu, or gelu_tanh
    norm_offset: bool = False  # RMSNorm scales by (1 + w), all in float32 (Gemma)
    sandwich_norms: bool = False  # norms after attention and around the MLP too (four per layer)
    embed_scale: bool = False  # embeddings times sqrt(hidden_size)
    attn_scale: float | None = None  # instead of head_dim ** -0.5 (Gemma: query_pre_attn_scalar ** -0.5)
    attn_softcap: float | None = None  # attention scores -> tanh(s / cap) * cap (Gemma 2)
    final_softcap: float | None = None  # the same for the logits
    # Per absolute layer, its attention window (None: full attention); None for a model without windows.
    layer_windows: tuple[int | None, ...] | None = None
    local_rope_theta: float | None = None  # the rope base of windowed layers, unscaled (Gemma 3's local layers)
    attn_sinks: bool = False  # a learned logit per head that joins every softmax and takes its share (gpt-oss)
    mla: MlaArgs | None = None  # multi-head latent attention (DeepSeek): head_dim is then its rotary part's width
    rotary_dim: int | None = None  # the leading head dimensions that rotate, if not all (Phi-4-mini)

    @property
    def rope_dim(self) -> int:
        return self.rotary_dim or self.head_dim

    def kv_layout(self) -> tuple[int, int, int]:
        """(heads, key width, value width) a position's cache entry holds in each layer: MLA caches one latent
        key, whose first kv_lora_rank values serve as the value (width 0: no value pool)."""
        if self.mla is not None:
            return 1, self.mla.latent_dim, 0
        return self.num_key_value_heads, self.head_dim, self.head_dim

    @property
    def family(self) -> Family:
        return family_for(self.model_type)

    def is_sparse_layer(self, layer: int) -> bool:
        """Whether absolute layer `layer` has a mixture of experts for its MLP."""
        return self.moe is not None and self.moe.is_sparse(layer)

    @property
    def context_length(self) -> int:
        """Positions a request may use."""
        return self.max_position_embeddings

    def window(self, layer: int) -> int | None:
        """The attention window of absolute layer `layer` (None: it attends to every earlier position)."""
        return None if self.layer_windows is None else self.layer_windows[layer]

    @property
    def kv_window(self) -> int | None:
        """The window of the sliding-window layers, whose KV pool keeps only that many positions a request
        (None: no layer has one). Families with windows give all their windowed layers the same one."""
        windows = {w for w in self.layer_windows or () if w is not None}
        if len(windows) > 1:
            raise ValueError(f"sliding windows of several sizes ({sorted(windows)}) are not supported")
        return windows.pop() if windows else None

    @classmethod
    def from_dict(cls, config: dict[str, Any]) -> "ModelArgs":
        model_type = config.get("model_type")
        family = family_for(model_type, (config.get("architectures") or [None])[0])
        hidden = int(config["hidden_size"])
        heads = int(config["num_attention_heads"])
        head_dim = int(config.get("head_dim") or hidden // heads)
        rope_theta, rope_scaling = rope_settings(config)
        fields: dict[str, Any] = dict(
            model_type=model_type,
            hidden_size=hidden,
            num_hidden_layers=int(config["num_hidden_layers"]),
            num_attention_heads=heads,
            num_key_value_heads=int(config.get("num_key_value_heads") or heads),
            head_dim=head_dim,
            intermediate_size=int(config["intermediate_size"]),
            vocab_size=int(config["vocab_size"]),
            rms_norm_eps=float(config.get("rms_norm_eps", 1e-6)),
            rope_theta=rope_theta,
            rope_scaling=rope_scaling,
            max_position_embeddings=int(config.get("max_position_embeddings", 4096)),
            tie_word_embeddings=bool(config.get("tie_word_embeddings", False)),
            torch_dtype=str(config.get("torch_dtype") or config.get("dtype") or "float32"),
            eos_token_ids=_as_id_tuple(config.get("eos_token_id")),
            bos_token_id=config.get("bos_token_id"),
            quantization=_quantization(config),
            rope_freq_factors=_rope_freq_factors(config.get("rope_freq_factors"), head_dim),
            rotary_dim=_rotary_dim(config, head_dim),
        )
        fields.update(family.parse(model_type, config))  # a family may also set common fields its own way
        args = cls(**fields)
        rope_inv_freq(args)  # checks the scaling's per-dimension factors against the rotary width, before loading
        return args

    @property
    def quant(self) -> QuantSpec | None:
        """The uniform MLX quantization of the checkpoint (validated in from_dict), None for float."""
        return quant_spec(self.quantization)

    @classmethod
    def from_dir(cls, model_dir: Path) -> "ModelArgs":
        """Read config.json, merging eos ids from generation_config.json (where eos may be a list)."""
        config = json.loads((model_dir / "config.json").read_text())
        args = cls.from_dict(config)
        gen_path = model_dir / "generation_config.json"
        if gen_path.exists():
            gen_eos = _as_id_tuple(json.loads(gen_path.read_text()).get("eos_token_id"))
            merged = tuple(dict.fromkeys(args.eos_token_ids + gen_eos))
            args = replace(args, eos_token_ids=merged)
        return args


def _as_id_tuple(value: Any) -> tuple[int, ...]:
    if value is None:
        return ()
    if isinstance(value, int):
        return (value,)
    return tuple(int(v) for v in value)


def _rotary_dim(config: dict[str, Any], head_dim: int) -> int | None:
    fraction = rotary_fraction(config)
    return None if fraction == 1.0 else int(head_dim * fraction)


def _rope_freq_factors(value: Any, head_dim: int) -> tuple[float, ...] | None:
    """llama.cpp's per-dimension frequency divisors, checked: one per rotary frequency, each positive."""
    if value is None:
        return None
    factors = tuple(float(v) for v in value)
    if len(factors) != head_dim // 2 or not all(np.isfinite(f) and f > 0 for f in factors):
        shown = ", ".join(f"{f:g}" for f in factors[:8]) + (", ..." if len(factors) > 8 else "")
        raise UnsupportedModelError(
            f"rope frequency factors (rope_freqs) must be {head_dim // 2} positive numbers (head_dim {head_dim}), "
            f"got {len(factors)}: [{shown}]", code="unsupported_rope_scaling")
    return factors


def rope_attention_factor(args: ModelArgs) -> float:
    """The factor both engines multiply cos and sin by (YaRN's; 1.0 otherwise)."""
    return attention_factor(args.rope_scaling)


def rope_inv_freq(args: ModelArgs) -> np.ndarray:
    """Inverse rotary frequencies (float32, head_dim // 2), with the config's scaling applied, then divided
    by a GGUF file's per-dimension factors as llama.cpp does (`theta / freq_factor`).

    Computed in float64 and rounded once, so both engines start from identical values.
    """
    inv_freq = scaled_inv_freq(args.rope_theta, args.rope_dim, args.rope_scaling)
    if args.rope_freq_factors is not None:
        inv_freq = inv_freq / np.asarray(args.rope_freq_factors, dtype=np.float64)
    return inv_freq.astype(np.float32)


def _quantization(config: dict[str, Any]) -> dict[str, Any] | None:
    """The config's quantization entry, checked now so an unsupported form fails before any weights move."""
    quantization = config.get("quantization") or config.get("quantization_config")
    quant_spec(quantization)
    return quantization
