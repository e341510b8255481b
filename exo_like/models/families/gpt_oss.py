"""gpt-oss (OpenAI's open-weight MoE): Llama's layout with
- biases on the q/k/v/o projections, and one learned attention *sink* logit per head that joins each softmax
  (it takes a share of the attention and is then dropped);
- sliding-window (128) and full attention alternating, as `layer_types` says (windowed first);
- YaRN rope (factor 32 over a 4k original context), cos and sin scaled by its attention factor;
- every MLP a mixture: a router with a bias, softmax over the top-k logits only, and experts with biases and a
  clamped SwiGLU (`swiglu_alpha`, `swiglu_limit`).
Its checkpoints stack the experts: `mlp.experts.gate_up_proj` [experts, hidden, 2 x inner] with gate and up
columns interleaved, `down_proj` [experts, inner, hidden], each with a `_bias`; they are turned into the shared
stacked layout (`mlp.switch_mlp.{gate,up,down}_proj.{weight,bias}`, [experts, out, in]) after reading. The Hub's
own checkpoints keep the experts in MXFP4 (`quant_method: mxfp4`): `gate_up_proj_blocks` [experts, 2 x inner,
hidden / 32, 16 bytes] with gate and up rows interleaved and `_scales` (one exponent byte per 32), which become
MLX's mxfp4 form (packed bytes as the weight, `.scales`). MLX-format checkpoints (mlx-lm's,
`mlp.experts.gate_proj.weight` stacked, MXFP4 or affine) only need the rename."""

from __future__ import annotations

from typing import Any

from exo_like.models.families.base import Family, MoeArgs, Router


def parse(model_type: str, config: dict[str, Any]) -> dict[str, Any]:
    n_layers = int(config["num_hidden_layers"])
    moe = MoeArgs(
        n_experts=int(config.get("num_local_experts") or config["num_experts"]),
        top_k=int(config.get("num_experts_per_tok") or config["experts_per_token"]),
        expert_size=int(config["intermediate_size"]),
        renormalize=False,
        sparse_layers=tuple(range(n_layers)),
        router=Router.SOFTMAX_OF_TOP_K,
        router_bias=True,
        expert_bias=True,
        activation="swiglu_clamped",
        swiglu_alpha=float(config.get("swiglu_alpha", 1.702)),
        swiglu_limit=float(config.get("swiglu_limit", 7.0)),
    )
    window = int(config.get("sliding_window") or 128)
    kinds = config.get("layer_types") or ["sliding_attention" if i % 2 == 0 else "full_attention"
                                          for i in range(n_layers)]
    bias = bool(config.get("attention_bias", True))
    return {"qkv_bias": bias, "o_bias": bias, "qk_norm": False, "mlp_bias": False, "moe": moe, "attn_sinks": True,
            "layer_windows": tuple(window if kind == "sliding_attention" else None for kind in kinds)}


_MXFP4_LEAVES = {"gate_up_proj_blocks": "weight", "gate_up_proj_scales": "scales", "down_proj_blocks": "weight",
                 "down_proj_scales": "scales"}


def convert(weights: dict[str, Any], _args: Any = None) -> dict[str, Any]:
    """Hugging Face's stacked experts ([experts, in, out], gate/up interleaved; MXFP4: [experts, out, ...], rows
    interleaved) -> [experts, out, in] stacks (MXFP4: packed bytes [experts, out, in / 2] and scales)."""
    out: dict[str, Any] = {}
    for name, array in weights.items():
        module, marker, leaf = name.rpartition(".mlp.experts.")
        stack = f"{module}.mlp.switch_mlp"
        if marker and leaf in _MXFP4_LEAVES:
            kind = _MXFP4_LEAVES[leaf]
            if kind == "weight":  # [experts, out, groups, 16 bytes] -> [experts, out, in / 2]
                array = array.reshape(*array.shape[:2], -1)
            if leaf.startswith("gate_up"):
                out[f"{stack}.gate_proj.{kind}"], out[f"{stack}.up_proj.{kind}"] = array[:, 0::2], array[:, 1::2]
            else:
                out[f"{stack}.down_proj.{kind}"] = array
        elif not marker or leaf not in ("gate_up_proj", "gate_up_proj_bias", "down_proj", "down_proj_bias"):
            out[name] = array
        elif leaf == "gate_up_proj":
            out[f"{stack}.gate_proj.weight"] = array[..., 0::2].swapaxes(1, 2)
            out[f"{stack}.up_proj.weight"] = array[..., 1::2].swapaxes(1, 2)
        elif leaf == "gate_up_proj_bias":
            out[f"{stack}.gate_proj.bias"], out[f"{stack}.up_proj.bias"] = array[..., 0::2], array[..., 1::2]
        elif leaf == "down_proj":
            out[f"{stack}.down_proj.weight"] = array.swapaxes(1, 2)
        else:
            out[f"{stack}.down_proj.bias"] = array
    return out


GPT_OSS = Family(
    name="gpt-oss",
    model_types=("gpt_oss",),
    summary="attention sinks, q/k/v/o biases, alternating 128-window and full layers, YaRN rope; every MLP a "
            "top-k-softmax mixture of biased experts with a clamped SwiGLU",
    parse=parse,
    renames=(
        (r"^mlp\.router\.", "mlp.gate."),
        (r"^mlp\.experts\.(gate_proj|up_proj|down_proj)\.", r"mlp.switch_mlp.\1."),  # MLX-format, stacked
    ),
    convert=convert,
)
