"""What a family declares: its model types, the config fields it adds to the common ones, its tensor renames."""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass
from enum import StrEnum
from typing import Any


class Router(StrEnum):
    """How a mixture of experts picks a token's experts and weighs them (MoeArgs)."""

    TOP_K_OF_SOFTMAX = "top_k_of_softmax"  # the top k of a softmax over every expert's logit (Qwen, Mixtral)
    SOFTMAX_OF_TOP_K = "softmax_of_top_k"  # a softmax over the top k logits alone (gpt-oss)
    GROUPED_SOFTMAX = "grouped_softmax"  # DeepSeek V2: the top k of a softmax among the best groups' experts
    GROUPED_SIGMOID = "grouped_sigmoid"  # DeepSeek V3: sigmoid scores, choices biased, among the best groups


@dataclass(frozen=True)
class MoeArgs:
    """A mixture-of-experts MLP: `top_k` of `n_experts` experts (SwiGLU, `expert_size` wide) per token, chosen by a
    router; optionally one always-on shared expert, scaled by a sigmoid gate (Qwen2-MoE).

    Routers (Router): TOP_K_OF_SOFTMAX takes the top k of a softmax over every expert (Qwen, Mixtral);
    SOFTMAX_OF_TOP_K a softmax over the top k logits alone (gpt-oss); GROUPED_SOFTMAX (DeepSeek V2) the top k of a
    softmax among the experts of the `topk_group` groups (of `n_group`) with the highest expert; GROUPED_SIGMOID
    (DeepSeek V3) sigmoid scores, choices made on scores + a learned per-expert bias among the groups whose two
    best such scores sum highest, weights the plain scores. `scale` multiplies the final weights
    (routed_scaling_factor). Activations: "silu" (SwiGLU), or gpt-oss's "swiglu_clamped":
    gate clamped above and up on both sides at `swiglu_limit`, then (up + 1) * gate * sigmoid(swiglu_alpha gate)."""

    n_experts: int
    top_k: int
    expert_size: int
    renormalize: bool  # divide the top-k probabilities by their sum (Qwen's norm_topk_prob; always for Mixtral)
    sparse_layers: tuple[int, ...]  # the absolute layers whose MLP is the mixture (others are dense)
    shared_expert_size: int = 0
    shared_expert_gated: bool = False
    router: Router = Router.TOP_K_OF_SOFTMAX
    router_bias: bool = False
    expert_bias: bool = False  # biases on every expert projection (gpt-oss)
    activation: str = "silu"
    swiglu_alpha: float = 1.702
    swiglu_limit: float = 7.0
    n_group: int = 1
    topk_group: int = 1
    scale: float = 1.0

    def is_sparse(self, layer: int) -> bool:
        return layer in self.sparse_layers


@dataclass(frozen=True)
class MlaArgs:
    """Multi-head latent attention (DeepSeek V2/V3): keys and values come from one small latent per position,
    `kv_lora_rank` wide, plus one `qk_rope_head_dim`-wide rotated key shared by every head. The cache holds only
    that (rank + rope values a position); queries optionally through a low-rank `q_lora_rank` bottleneck.
    `interleaved`: the checkpoint pairs rotary dimensions (x0, x1), (x2, x3)... (both DeepSeek versions)."""

    q_lora_rank: int | None
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    interleaved: bool = True

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def latent_dim(self) -> int:
        """Values a position's latent key holds in the cache."""
        return self.kv_lora_rank + self.qk_rope_head_dim


ConfigParser = Callable[[str, dict[str, Any]], dict[str, Any]]


@dataclass(frozen=True)
class Family:
    """name: the family as the README lists it; summary: what differs from Llama, in one line.
    parse(model_type, config) returns the ModelArgs fields the family sets beyond the common ones.
    renames: (pattern, replacement) pairs applied to a layer tensor's name after `model.layers.N.` so that every
    family's checkpoint reaches the engines under the shared names.
    convert: see below."""

    name: str
    model_types: tuple[str, ...]
    summary: str
    parse: ConfigParser
    renames: tuple[tuple[str, str], ...] = ()
    # Tensors the family's checkpoints store in a layout of their own, turned into the shared one after reading (on
    # the engine's arrays, torch or MLX: slicing, reshapes and swapaxes only), given the parsed ModelArgs. Local names
    # in, local names out.
    convert: Callable[[dict[str, Any], Any], dict[str, Any]] | None = None

    def converted(self, weights: dict[str, Any], args: Any) -> dict[str, Any]:
        return weights if self.convert is None else self.convert(weights, args)

    def rename(self, layer_tensor: str) -> str:
        for pattern, replacement in self.renames:
            layer_tensor = re.sub(pattern, replacement, layer_tensor)
        return layer_tensor


def sparse_layers(config: dict[str, Any], n_experts: int) -> tuple[int, ...]:
    """Qwen-MoE's rule: a layer is a mixture unless listed in `mlp_only_layers`, every `decoder_sparse_step`-th."""
    n_layers = int(config["num_hidden_layers"])
    step = int(config.get("decoder_sparse_step") or 1)
    dense = set(config.get("mlp_only_layers") or ())
    return tuple(i for i in range(n_layers) if n_experts > 0 and i not in dense and (i + 1) % step == 0)
