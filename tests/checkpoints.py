"""Small random Hugging Face checkpoints for the tests, built with `transformers` itself (the oracle).

Each architecture gets the features its real checkpoints have: Llama 3.1 rope scaling, Qwen2 q/k/v bias and tied
embeddings, Qwen3 q/k norms with head_dim != hidden / heads, Mistral GQA; the mixtures of experts several experts,
top-k > 1, a dense layer among sparse ones (Qwen3-MoE), a gated shared expert (Qwen2-MoE). Weights are scaled so
logits are peaky and routers' choices clear-cut, so greedy decoding is exact across correct implementations.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Callable

import torch

from exo_like.models.demo import BOS, EOS, EOT, build_tokenizer, write_tokenizer_files

ARCHITECTURES = ("llama", "mistral", "qwen2", "qwen3")
MOE_ARCHITECTURES = ("qwen3_moe", "qwen2_moe", "mixtral")
FUSED_ARCHITECTURES = ("phi3",)  # q/k/v and gate/up stored fused
GEMMA_ARCHITECTURES = ("gemma2", "gemma3_text")  # sliding windows (8) shorter than the test prompts
SINK_ARCHITECTURES = ("gpt_oss",)  # attention sinks, windows of 8, YaRN, biased experts stacked [E, in, out]
# latent attention (ranks 32, rope 8), a dense first layer, shared + routed experts in groups, YaRN with mscale
MLA_ARCHITECTURES = ("deepseek_v3", "deepseek_v2")

_COMMON = dict(
    hidden_size=64,
    intermediate_size=160,
    num_attention_heads=4,
    num_key_value_heads=2,
    rms_norm_eps=1e-5,
    max_position_embeddings=4096,
)

_SPECIFIC = {
    "llama": dict(
        max_position_embeddings=131072,
        rope_theta=500000.0,
        rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                      "original_max_position_embeddings": 8192},
        tie_word_embeddings=False,
    ),
    "mistral": dict(rope_theta=1000000.0, sliding_window=None, tie_word_embeddings=False),
    "qwen2": dict(rope_theta=1000000.0, tie_word_embeddings=True),
    "qwen3": dict(rope_theta=1000000.0, head_dim=24, tie_word_embeddings=True),
    "qwen3_moe": dict(rope_theta=1000000.0, head_dim=24, tie_word_embeddings=False, num_experts=8,
                      num_experts_per_tok=3, moe_intermediate_size=64, norm_topk_prob=True, mlp_only_layers=[1]),
    "qwen2_moe": dict(rope_theta=1000000.0, tie_word_embeddings=False, num_experts=8, num_experts_per_tok=2,
                      moe_intermediate_size=64, shared_expert_intermediate_size=96, norm_topk_prob=False),
    "mixtral": dict(rope_theta=1000000.0, intermediate_size=96, num_local_experts=6, num_experts_per_tok=2,
                    tie_word_embeddings=False),
    "phi3": dict(rope_theta=10000.0, tie_word_embeddings=False, sliding_window=None, pad_token_id=0),
    # head_dim 16, queries scaled by 24 ** -0.5; Gemma 2 soft-caps scores (50) and logits (30) by default
    "gemma2": dict(head_dim=16, query_pre_attn_scalar=24, sliding_window=8, pad_token_id=0),
    "gemma3_text": dict(head_dim=16, query_pre_attn_scalar=24, sliding_window=8, pad_token_id=0,
                        rope_scaling={"rope_type": "linear", "factor": 4.0}, sliding_window_pattern=3),
    # gpt-oss's own rope (YaRN, factor 32 over 4096) and alternating windowed/full layers, at a small size
    "deepseek_v3": dict(q_lora_rank=32, kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16,
                        num_key_value_heads=4, intermediate_size=96, moe_intermediate_size=32, n_routed_experts=8,
                        num_experts_per_tok=2, n_group=4, topk_group=2, n_shared_experts=1, first_k_dense_replace=1,
                        routed_scaling_factor=2.5, norm_topk_prob=True, max_position_embeddings=163840,
                        scoring_func="sigmoid", topk_method="noaux_tc",  # as the Hub's config.json says
                        rope_scaling={"rope_type": "yarn", "factor": 40.0, "mscale": 1.0, "mscale_all_dim": 1.0,
                                      "beta_fast": 32, "beta_slow": 1, "original_max_position_embeddings": 4096},
                        tie_word_embeddings=False),
    # DeepSeek-V2-Lite's plain query projection, with V2's group-limited softmax routing
    "deepseek_v2": dict(q_lora_rank=None, kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16,
                        num_key_value_heads=4, intermediate_size=96, moe_intermediate_size=32, n_routed_experts=8,
                        num_experts_per_tok=2, topk_method="group_limited_greedy", n_group=4, topk_group=2,
                        n_shared_experts=2, first_k_dense_replace=1, routed_scaling_factor=1.5,
                        tie_word_embeddings=False),
    "gpt_oss": dict(head_dim=16, intermediate_size=64, num_local_experts=6, num_experts_per_tok=2, sliding_window=8,
                    max_position_embeddings=131072, pad_token_id=0),
}
# Phi-3-mini-128k's LongRoPE over an original window of 32 (the prompts pass it, so transformers uses the long factors
# throughout, as we always do), with Phi-4-mini's partial rotary: 3/4 of each head's 16 dimensions, 6 factors each
PHI3_LONGROPE = ("phi3", {
    "max_position_embeddings": 4096, "original_max_position_embeddings": 32, "partial_rotary_factor": 0.75,
    "rope_scaling": {"rope_type": "longrope", "original_max_position_embeddings": 32,
                     "short_factor": [1.0, 1.1, 1.3, 1.6, 2.0, 2.5], "long_factor": [1.0, 1.5, 3.0, 6.0, 12.0, 24.0]}})
POST_NORM_OFFSET = 2.0
ROUTER_SCALE = 6.0  # router logits' spread: top-k choices far from ties, so summation order never flips one


def hf_config(arch: str, n_layers: int, vocab_size: int, token_ids: dict[str, int], **overrides):
    import transformers

    config_class = getattr(transformers, {
        "llama": "LlamaConfig", "mistral": "MistralConfig", "qwen2": "Qwen2Config", "qwen3": "Qwen3Config",
        "qwen3_moe": "Qwen3MoeConfig", "qwen2_moe": "Qwen2MoeConfig", "mixtral": "MixtralConfig",
        "phi3": "Phi3Config", "gemma2": "Gemma2Config", "gemma3_text": "Gemma3TextConfig",
        "gpt_oss": "GptOssConfig", "deepseek_v3": "DeepseekV3Config", "deepseek_v2": "DeepseekV2Config"}[arch])
    settings = {**_COMMON, **_SPECIFIC[arch], **overrides}
    return config_class(
        num_hidden_layers=n_layers,
        vocab_size=vocab_size,
        bos_token_id=token_ids[BOS],
        eos_token_id=token_ids[EOT],
        **settings,
    )


@torch.no_grad()
def make_peaky(model: torch.nn.Module, seed: int) -> None:
    """Re-initialise: linear std 1.5/sqrt(fan_in) (routers ROUTER_SCALE/sqrt(fan_in)), norms 1 +- 0.1 (Gemma's
    offsets 0 +- 0.1), biases small, embeddings unit normal."""
    generator = torch.Generator().manual_seed(seed)
    # Gemma's norms scale by (1 + w): their weights are offsets, about 0; its embeddings are scaled up by
    # sqrt(hidden) on the way in, so they are drawn that much smaller (unit rows after scaling, as for the others).
    gemma = getattr(model.config, "model_type", "").startswith("gemma")
    norm_centre, embed_std = (0.0, model.config.hidden_size**-0.5) if gemma else (1.0, 1.0)
    for name, param in sorted(model.named_parameters()):
        if "norm" in name:
            # Gemma's layers add their outputs normalised ("post" norms): scaled up, as trained ones are, they
            # outweigh the embedding in the residual stream; its final norm scaled up makes the (tied, small)
            # head's logits peaky.
            centre = POST_NORM_OFFSET if gemma and (".post_" in name or name == "model.norm.weight") else norm_centre
            param.copy_(centre + (torch.rand(param.shape, generator=generator) - 0.5) * 0.2)
        elif name.endswith("bias"):
            param.copy_(torch.randn(param.shape, generator=generator) * 0.5)
        elif "embed_tokens" in name:
            param.copy_(torch.randn(param.shape, generator=generator) * embed_std)
        elif name.endswith(".sinks"):  # gpt-oss: a sink logit comparable with the scores, so it takes a share
            param.copy_(torch.randn(param.shape, generator=generator) * 2.0)
        else:
            # gpt-oss stacks its experts [experts, in, out]; every other matrix is [out, in] (stacks too)
            fan_in = param.shape[-2] if param.dim() == 3 and model.config.model_type == "gpt_oss" else param.shape[-1]
            scale = ROUTER_SCALE if name.endswith((".gate.weight", ".router.weight")) else 1.5
            param.copy_(torch.randn(param.shape, generator=generator) * scale / math.sqrt(fan_in))
    for name, buffer in sorted(model.named_buffers()):
        if name.endswith("e_score_correction_bias"):  # DeepSeek V3's routing bias: small, but enough to matter
            buffer.copy_(torch.randn(buffer.shape, generator=generator) * 0.1)


def make_checkpoint(
    path: Path,
    arch: str,
    *,
    n_layers: int = 4,
    dtype: torch.dtype = torch.float32,
    max_shard_size: str | None = None,
    seed: int = 0,
    hub_style_config: bool = False,
    peaky: bool = True,
    chat_template: str | None = None,
    **config_overrides,
) -> Path:
    """Write a complete HF model folder (weights, config, tokenizer, chat template, generation config).

    peaky=False keeps transformers' own initialisation (small weights: nearly uniform next-token distributions, a
    model that samples almost at random; peaky ones fall into loops).
    hub_style_config rewrites config.json the way checkpoints on the Hub have it (`rope_theta` and
    `rope_scaling` at the top level, `torch_dtype`) instead of transformers >= 5's `rope_parameters`.
    """
    from transformers import AutoModelForCausalLM

    path.mkdir(parents=True, exist_ok=True)
    tokenizer = build_tokenizer()
    token_ids = write_tokenizer_files(path, tokenizer)
    if chat_template is not None:  # e.g. one that renders tools (tests/chat_templates.py)
        tokenizer_config = json.loads((path / "tokenizer_config.json").read_text())
        (path / "tokenizer_config.json").write_text(json.dumps({**tokenizer_config, "chat_template": chat_template}))
    config = hf_config(arch, n_layers, tokenizer.get_vocab_size(), token_ids, **config_overrides)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    if peaky:
        make_peaky(model, seed)
    model = model.to(dtype)
    save_kwargs = {"max_shard_size": max_shard_size} if max_shard_size else {}
    model.save_pretrained(path, **save_kwargs)
    if hub_style_config:
        to_hub_style_config(path / "config.json")
    # The Hub's generation configs list several eos ids; keep that shape.
    (path / "generation_config.json").write_text(
        json.dumps({"bos_token_id": token_ids[BOS], "eos_token_id": [token_ids[EOT], token_ids[EOS]]})
    )
    return path


def to_hub_style_config(config_path: Path) -> None:
    config = json.loads(config_path.read_text())
    rope = dict(config.pop("rope_parameters", None) or {})
    config["rope_theta"] = rope.pop("rope_theta", 10000.0)
    rope_type = rope.get("rope_type", "default")
    config["rope_scaling"] = None if rope_type == "default" else rope
    config["torch_dtype"] = config.pop("dtype", "float32")
    if config["model_type"] in ("qwen2_moe", "qwen3_moe") and "num_local_experts" in config:
        config["num_experts"] = config.pop("num_local_experts")  # the Hub's name; transformers 5 renames it
    config_path.write_text(json.dumps(config, indent=2))


def built_once(root: Path, build: Callable[[str, Path], Path]) -> Callable[[str], Path]:
    """name -> checkpoint folder, built by `build(name, root / name)` on first use and reused after."""
    made: dict[str, Path] = {}

    def get(name: str) -> Path:
        if name not in made:
            made[name] = build(name, root / name)
        return made[name]

    return get


# FP4 (E2M1) values by nibble, as MXFP4 stores them (sign in bit 3).
FP4_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)


def mxfp4_quantize(weight: "np.ndarray") -> tuple["np.ndarray", "np.ndarray"]:  # noqa: F821
    """[..., out, in] float32 -> (blocks uint8 [..., out, in / 32, 16], exponents uint8 [..., out, in / 32]): per
    32 inputs a power-of-two scale 2^(e - 127) that puts the largest magnitude in [4, 8), each value the nearest
    FP4 value (two to a byte, the first in the low nibble): the Hub's gpt-oss layout, and ggml's choice of e."""
    import numpy as np

    groups = weight.reshape(*weight.shape[:-1], -1, 32).astype(np.float32)
    top = np.abs(groups).max(-1)
    exponents = np.where(top > 0, np.floor(np.log2(np.maximum(top, 1e-30))) - 2 + 127, 0).clip(0, 254)
    scaled = groups / np.ldexp(np.float32(1), exponents.astype(np.int32) - 127)[..., None]
    nibbles = np.abs(scaled[..., None] - np.array(FP4_VALUES, dtype=np.float32)).argmin(-1).astype(np.uint8)
    return nibbles[..., 0::2] | (nibbles[..., 1::2] << 4), exponents.astype(np.uint8)


def make_mxfp4_checkpoint(float_dir: Path, path: Path) -> Path:
    """A gpt-oss folder as the Hub's openai/gpt-oss checkpoints are: the experts' matrices in MXFP4
    (`*_blocks` [experts, out, in / 32, 16], `*_scales`, rows of gate and up interleaved), everything else as in
    `float_dir`, `quantization_config: {quant_method: mxfp4}`."""
    import shutil

    import numpy as np
    from safetensors.numpy import load_file, save_file

    path.mkdir(parents=True, exist_ok=True)
    for file in float_dir.iterdir():
        if file.suffix != ".safetensors" and file.name != "model.safetensors.index.json":
            shutil.copy(file, path / file.name)
    tensors = load_file(str(float_dir / "model.safetensors"))
    for name in [n for n in tensors if n.endswith(".mlp.router.weight")]:
        # held at 8 bits by the MLX form (make_mlx_mxfp4_checkpoint): both forms then hold the same values
        tensors[name] = affine8(tensors[name]).dequantize()
    for name in [n for n in tensors if n.endswith((".mlp.experts.gate_up_proj", ".mlp.experts.down_proj"))]:
        # the checkpoint's [experts, in, out] as [experts, out, in], gate and up rows interleaved as its columns were
        blocks, scales = mxfp4_quantize(np.ascontiguousarray(tensors.pop(name).swapaxes(1, 2)))
        tensors[f"{name}_blocks"], tensors[f"{name}_scales"] = blocks, scales
    save_file(tensors, str(path / "model.safetensors"), metadata={"format": "pt"})
    config = json.loads((path / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "mxfp4", "modules_to_not_convert": [
        "model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens", "lm_head"]}
    (path / "config.json").write_text(json.dumps(config, indent=2))
    return path


def affine8(weight: "np.ndarray") -> "AffineGroups":  # noqa: F821
    """8-bit affine groups of 64 (mlx-lm's router setting) with scales and biases exact in float16."""
    import numpy as np

    from exo_like.models.affine import AffineGroups

    groups = weight.reshape(weight.shape[0], -1, 64).astype(np.float32)
    low, high = groups.min(-1), groups.max(-1)
    scales = ((high - low) / 255).astype(np.float16).astype(np.float32)
    biases = low.astype(np.float16).astype(np.float32)
    codes = np.clip(np.round((groups - biases[..., None]) / scales[..., None]), 0, 255).astype(np.uint8)
    return AffineGroups(codes.reshape(weight.shape), scales, biases, 8, 64, "test 8-bit")


def make_mlx_mxfp4_checkpoint(hub_dir: Path, path: Path) -> Path:
    """The MXFP4 gpt-oss folder `hub_dir` as mlx-community's conversions lay it out: the experts stacked per
    projection (`mlp.experts.gate_proj.weight` uint32 words, `.scales`, `.bias`), `quantization: {mode: mxfp4}`,
    the routers at 8 bits under their own (checkpoint) names in the config."""
    import shutil

    import numpy as np
    from safetensors.numpy import load_file, save_file

    from exo_like.models.affine import pack_words

    path.mkdir(parents=True, exist_ok=True)
    for file in hub_dir.iterdir():
        if file.suffix != ".safetensors":
            shutil.copy(file, path / file.name)
    tensors = load_file(str(hub_dir / "model.safetensors"))
    for name in [n for n in tensors if ".mlp.experts." in n]:
        values = tensors.pop(name)
        module, _, leaf = name.rpartition(".")
        stem, _, kind = leaf.rpartition("_") if leaf.endswith(("_blocks", "_scales", "_bias")) else (leaf, "", "")
        kind = {"blocks": "weight", "scales": "scales", "bias": "bias"}[kind]
        if kind == "weight":
            values = values.reshape(*values.shape[:2], -1)
        parts = {"gate_proj": values[:, 0::2], "up_proj": values[:, 1::2]} if stem == "gate_up_proj" else \
            {"down_proj": values}
        for projection, part in parts.items():
            part = np.ascontiguousarray(part)
            tensors[f"{module}.{projection}.{kind}"] = part.view(np.uint32) if kind == "weight" else part
    routers = [n.removesuffix(".weight") for n in tensors if n.endswith(".mlp.router.weight")]
    for router in routers:
        groups = affine8(tensors[f"{router}.weight"])
        tensors[f"{router}.weight"] = pack_words(groups.codes, 8)
        tensors[f"{router}.scales"], tensors[f"{router}.biases"] = groups.scales, groups.biases
    save_file(tensors, str(path / "model.safetensors"), metadata={"format": "mlx"})
    config = json.loads((path / "config.json").read_text())
    del config["quantization_config"]
    config["quantization"] = {"group_size": 32, "bits": 4, "mode": "mxfp4",
                              **{router: {"group_size": 64, "bits": 8} for router in routers}}
    (path / "config.json").write_text(json.dumps(config, indent=2))
    return path
