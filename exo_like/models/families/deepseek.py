"""DeepSeek V2 and V3 (and the models built on V3: R1, Kimi K2): Llama's layer with
- multi-head latent attention (MlaArgs): queries through a low-rank bottleneck (V2-Lite: a plain projection), keys
  and values from one normalised latent per position plus a rotated key shared by all heads; the scale is
  1/sqrt(nope + rope dims) times YaRN's mscale squared (`mscale_all_dim`);
- the first `first_k_dense_replace` layers dense, every later MLP a mixture with always-on shared experts
  (`n_shared_experts` x `moe_intermediate_size` wide, one MLP) and routed experts weighted by
  `routed_scaling_factor`: V2 a softmax router (greedy, or limited to the best groups), V3 sigmoid scores with a
  per-expert correction bias and group-limited choice (MoeArgs routers), renormalised where `norm_topk_prob`;
- rotary dimensions paired (x0, x1), (x2, x3)...: the checkpoint's rotary rows are reordered at load to halves
  (evens, then odds), which rotate-half turns into exactly what DeepSeek computes (transformers' V3 path gives its
  results in that order too).
- kv_b_proj [heads x (nope + v), rank] split at load into per-head projections of the absorbed form (see
  engines/torch/mla.py): `embed_q` [heads, rank, nope] folds a head's query into latent space, `unembed_out`
  [heads, v, rank] unfolds its attention output; a quantized kv_b_proj stays quantized: its value rows are
  unembed_out as stored, its key rows `k_b_proj` [heads x nope, rank] (groups along the rank: embed_q's
  transpose, which each engine multiplies as it can). GGUF files hold embed_q and unembed_out already
  (`attn_k_b`, `attn_v_b`). Quantized per-head projections are row stacks [heads x out, in]; float ones
  [heads, out, in].
The small q/kv normalisations use eps 1e-6 whatever the config says (transformers' modules do)."""

from __future__ import annotations

from typing import Any

import numpy as np

from exo_like.models.families.base import Family, MlaArgs, MoeArgs, Router
from exo_like.models.rope import rope_settings, yarn_mscale


def parse(model_type: str, config: dict[str, Any]) -> dict[str, Any]:
    n_layers = int(config["num_hidden_layers"])
    v3 = model_type in ("deepseek_v3", "kimi_k2")  # Kimi K2 is DeepSeek V3's architecture, its own name
    mla = MlaArgs(
        q_lora_rank=int(config["q_lora_rank"]) if config.get("q_lora_rank") else None,
        kv_lora_rank=int(config["kv_lora_rank"]),
        qk_nope_head_dim=int(config["qk_nope_head_dim"]),
        qk_rope_head_dim=int(config["qk_rope_head_dim"]),
        v_head_dim=int(config["v_head_dim"]),
        interleaved=bool(config.get("rope_interleave", True)) if v3 else True,
    )
    n_experts = int(config.get("n_routed_experts") or config.get("num_local_experts") or config["num_experts"])
    first_dense = int(config.get("first_k_dense_replace") or 0)
    grouped = v3 or config.get("topk_method") == "group_limited_greedy"
    moe = MoeArgs(
        n_experts=n_experts,
        top_k=int(config["num_experts_per_tok"]),
        expert_size=int(config["moe_intermediate_size"]),
        renormalize=v3 and bool(config.get("norm_topk_prob", False)),  # transformers' V2 never renormalises
        sparse_layers=tuple(range(first_dense, n_layers)),
        shared_expert_size=int(config["moe_intermediate_size"]) * int(config.get("n_shared_experts") or 0),
        router=(Router.GROUPED_SIGMOID if v3 else Router.GROUPED_SOFTMAX) if grouped else Router.TOP_K_OF_SOFTMAX,
        n_group=int(config.get("n_group") or 1) if grouped else 1,
        topk_group=int(config.get("topk_group") or 1) if grouped else 1,
        scale=float(config.get("routed_scaling_factor") or 1.0),
    )
    _, scaling = rope_settings(config)
    scale = mla.qk_head_dim ** -0.5
    if scaling is not None and scaling.get("mscale_all_dim"):
        scale *= yarn_mscale(float(scaling["factor"]), float(scaling["mscale_all_dim"])) ** 2
    bias = bool(config.get("attention_bias", False))
    return {"mla": mla, "moe": moe, "head_dim": mla.qk_rope_head_dim, "attn_scale": scale, "qkv_bias": bias,
            "o_bias": False, "qk_norm": False, "mlp_bias": False,
            "num_key_value_heads": int(config["num_attention_heads"])}


# The per-head projections' shared names (their tensor-parallel split is by head).
EMBED_Q, UNEMBED_OUT, KEY_ROWS = "embed_q", "unembed_out", "k_b_proj"
PER_HEAD = (EMBED_Q, UNEMBED_OUT, KEY_ROWS)


def convert(weights: dict[str, Any], args: Any) -> dict[str, Any]:
    """The shared layout: rotary rows in halves (see _halve_rotary_rows), kv_b_proj per head (split_kv_b)."""
    return split_kv_b(_halve_rotary_rows(weights, args), args)


def split_kv_b(weights: dict[str, Any], args: Any) -> dict[str, Any]:
    """Every kv_b_proj as embed_q and unembed_out (float), or k_b_proj and unembed_out row stacks (quantized: a
    packed weight with its scales and biases, or AffineGroups); see the module's docstring."""
    mla: MlaArgs = args.mla
    heads, nope, v = args.num_attention_heads, mla.qk_nope_head_dim, mla.v_head_dim
    per_head = np.arange(heads)[:, None] * (nope + v)
    key_rows, value_rows = (per_head + np.arange(nope)).reshape(-1), (per_head + nope + np.arange(v)).reshape(-1)
    for name in [n for n in weights if n.endswith(".kv_b_proj.weight")]:
        prefix = name.removesuffix("kv_b_proj.weight")
        quantized = f"{prefix}kv_b_proj.scales" in weights or hasattr(weights[name], "map_rows")
        for leaf in ("weight", "scales", "biases"):
            if f"{prefix}kv_b_proj.{leaf}" not in weights:
                continue
            stack = weights.pop(f"{prefix}kv_b_proj.{leaf}")
            keys, values = _take_rows(stack, key_rows), _take_rows(stack, value_rows)
            if quantized:
                weights[f"{prefix}{KEY_ROWS}.{leaf}"], weights[f"{prefix}{UNEMBED_OUT}.{leaf}"] = keys, values
            else:
                weights[f"{prefix}{EMBED_Q}.{leaf}"] = _contiguous(keys.reshape(heads, nope, -1).swapaxes(1, 2))
                weights[f"{prefix}{UNEMBED_OUT}.{leaf}"] = values.reshape(heads, v, -1)
    return weights


def _contiguous(array: Any) -> Any:
    """A torch tensor's or numpy array's contiguous copy (MLX arrays are made contiguous as they are computed)."""
    if hasattr(array, "contiguous"):
        return array.contiguous()
    return np.ascontiguousarray(array) if isinstance(array, np.ndarray) else array


def _halve_rotary_rows(weights: dict[str, Any], args: Any) -> dict[str, Any]:
    """Rotary rows in pairs -> in halves: each head's rope rows of the query projection, and the shared rope key's
    rows of `kv_a_proj_with_mqa` (weights, biases, and a quantized matrix's scales and biases alike)."""
    mla: MlaArgs = args.mla
    if not mla.interleaved:
        return weights
    rope, nope, rank = mla.qk_rope_head_dim, mla.qk_nope_head_dim, mla.kv_lora_rank
    halves = np.concatenate([np.arange(0, rope, 2), np.arange(1, rope, 2)])
    heads = args.num_attention_heads
    query = np.concatenate([np.concatenate([np.arange(nope), nope + halves]) + h * mla.qk_head_dim
                            for h in range(heads)])
    latent = np.concatenate([np.arange(rank), rank + halves])
    for name in list(weights):
        module = name.rpartition(".")[0].rpartition(".")[2]
        rows = {"q_proj": query, "q_b_proj": query, "kv_a_proj_with_mqa": latent}.get(module)
        if rows is not None and weights[name].shape[0] == len(rows):
            weights[name] = _take_rows(weights[name], rows)
    return weights


def _take_rows(array: Any, rows: Any) -> Any:
    """array[rows] for a torch tensor (which takes a numpy index), an MLX array (which takes its own arrays) or
    quantized AffineGroups (a GGUF matrix read as is)."""
    if hasattr(array, "map_rows"):
        return array.map_rows(lambda values: values[rows])
    try:
        return array[rows]
    except ValueError:
        return array[type(array)(rows)]


DEEPSEEK = Family(
    name="DeepSeek V2, DeepSeek V3",
    model_types=("deepseek_v2", "deepseek_v3", "kimi_k2"),
    summary="multi-head latent attention (the cache holds one latent + one rotated key a position), dense first "
            "layers, shared + routed experts (V2 softmax, V3 sigmoid with bias and group-limited choice)",
    parse=parse,
    renames=(
        (r"^mlp\.shared_experts\.", "mlp.shared_expert."),
        (r"^mlp\.gate\.e_score_correction_bias$", "mlp.e_score_correction_bias"),
    ),
    convert=convert,
)
