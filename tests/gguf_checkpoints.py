"""Random GGUF checkpoints for the tests, written with `gguf`'s own writer from the tests' Hugging Face folders.

The tensors are laid out as llama.cpp's converter writes them (its names; for the llama architecture the query
and key rows reordered for its rotary embedding; llama3 rope scaling as a `rope_freqs` tensor of per-dimension
factors, first in the file), the tokenizer is the folder's byte-level BPE as a `gpt2` vocabulary, and each
matrix is stored in the tensor type asked for (quantized with `gguf.quants`).
"""

from __future__ import annotations

import json
import math
import re
from pathlib import Path

import numpy as np
from safetensors.numpy import load_file

from tests import gguf_deepseek

_LAYER_PARTS = {
    "input_layernorm.weight": "attn_norm.weight",
    "post_attention_layernorm.weight": "ffn_norm.weight",
    "self_attn.q_proj.weight": "attn_q.weight",
    "self_attn.k_proj.weight": "attn_k.weight",
    "self_attn.v_proj.weight": "attn_v.weight",
    "self_attn.q_proj.bias": "attn_q.bias",
    "self_attn.k_proj.bias": "attn_k.bias",
    "self_attn.v_proj.bias": "attn_v.bias",
    "self_attn.o_proj.weight": "attn_output.weight",
    "mlp.gate_proj.weight": "ffn_gate.weight",
    "mlp.up_proj.weight": "ffn_up.weight",
    "mlp.down_proj.weight": "ffn_down.weight",
}


_LAYER_PARTS.update({
    "self_attn.q_norm.weight": "attn_q_norm.weight",
    "self_attn.k_norm.weight": "attn_k_norm.weight",
    "mlp.gate.weight": "ffn_gate_inp.weight",
    "mlp.shared_expert_gate.weight": "ffn_gate_inp_shexp.weight",
    "mlp.shared_expert.gate_proj.weight": "ffn_gate_shexp.weight",
    "mlp.shared_expert.up_proj.weight": "ffn_up_shexp.weight",
    "mlp.shared_expert.down_proj.weight": "ffn_down_shexp.weight",
})
# HF model_type -> llama.cpp's architecture (Mixtral is `llama` with experts).
GGUF_ARCHITECTURES = {"llama": "llama", "mistral": "llama", "qwen2": "qwen2", "qwen3": "qwen3",
                      "qwen2_moe": "qwen2moe", "qwen3_moe": "qwen3moe", "mixtral": "llama", "phi3": "phi3",
                      "gemma2": "gemma2", "gemma3_text": "gemma3", "gpt_oss": "gpt-oss", "deepseek_v3": "deepseek2",
                      "deepseek_v2": "deepseek2"}
# Gemma's norm names (its `ffn_norm` is the norm before the MLP); its norms are stored with the 1 of (1 + w) added.
_GEMMA_PARTS = {"post_attention_layernorm.weight": "post_attention_norm.weight",
                "pre_feedforward_layernorm.weight": "ffn_norm.weight",
                "post_feedforward_layernorm.weight": "post_ffw_norm.weight"}
# Phi-3's fused projections keep their names' roles: q/k/v as `attn_qkv`, gate/up as `ffn_up` (llama.cpp's phi3).
_PHI3_PARTS = {"self_attn.qkv_proj.weight": "attn_qkv.weight", "mlp.gate_up_proj.weight": "ffn_up.weight"}
# gpt-oss: its router is `ffn_gate_inp` with a bias, its sinks `attn_sinks`, its norm before the MLP
# `post_attention_norm`.
_GPT_OSS_PARTS = {"post_attention_layernorm.weight": "post_attention_norm.weight",
                  "self_attn.sinks": "attn_sinks.weight",
                  "mlp.router.weight": "ffn_gate_inp.weight", "mlp.router.bias": "ffn_gate_inp.bias",
                  "self_attn.o_proj.bias": "attn_output.bias"}
_MIXTRAL_NAMES = {"block_sparse_moe.gate.": "mlp.gate.", ".w1.": ".gate_proj.", ".w2.": ".down_proj.",
                  ".w3.": ".up_proj.", "block_sparse_moe.experts.": "mlp.experts."}
_EXPERT = re.compile(r"^model\.layers\.(\d+)\.mlp\.experts\.(\d+)\.(\w+)_proj\.weight$")


def gguf_name(hf_name: str, gemma: bool = False, gpt_oss: bool = False) -> str:
    if hf_name.startswith("model.layers."):
        _, _, layer, rest = hf_name.split(".", 3)
        own = {**(_GEMMA_PARTS if gemma else {}), **(_GPT_OSS_PARTS if gpt_oss else {}), **_PHI3_PARTS}
        return f"blk.{layer}.{own.get(rest) or _LAYER_PARTS[rest]}"
    return {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
            "lm_head.weight": "output.weight"}[hf_name]


def permute_rotary_rows(weight: np.ndarray, n_heads: int) -> np.ndarray:
    """What llama.cpp's converter does to llama query/key rows (pairs (i, i + d/2) of each head side by side)."""
    half = weight.shape[0] // n_heads // 2
    return weight.reshape(n_heads, 2, half, *weight.shape[1:]).swapaxes(1, 2).reshape(weight.shape)


def llama3_rope_factors(config: dict) -> np.ndarray | None:
    """llama.cpp's `rope_freqs` for a llama3-scaled config, None for any other: its converter's computation
    (convert_hf_to_gguf.py, LlamaModel.generate_extra_tensors), float32 as there. llama.cpp divides each rotary
    frequency by its factor."""
    import torch

    rope = config.get("rope_parameters") or config.get("rope_scaling") or {}
    if rope.get("rope_type", rope.get("type", "")).lower() != "llama3":
        return None
    base = rope.get("rope_theta", config.get("rope_theta", 10000.0))
    dim = config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]
    freqs = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim))
    factor = rope.get("factor", 8.0)
    low_freq_factor = rope.get("low_freq_factor", 1.0)
    high_freq_factor = rope.get("high_freq_factor", 4.0)
    old_context_len = rope.get("original_max_position_embeddings", 8192)
    low_freq_wavelen = old_context_len / low_freq_factor
    high_freq_wavelen = old_context_len / high_freq_factor
    rope_factors = []
    for freq in freqs:
        wavelen = 2 * math.pi / freq
        if wavelen < high_freq_wavelen:
            rope_factors.append(1)
        elif wavelen > low_freq_wavelen:
            rope_factors.append(factor)
        else:
            smooth = (old_context_len / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
            rope_factors.append(1 / ((1 - smooth) / factor + smooth))
    return torch.tensor(rope_factors, dtype=torch.float32).numpy()


def write_gguf(hf_dir: Path, out: Path, matrix_type: str = "F32", embedding_type: str | None = None,
               split_max_tensors: int = 0, types: dict[str, str] | None = None) -> Path:
    """`hf_dir` (a tests/checkpoints.py folder, float32, llama or qwen2) as one GGUF file: 2-D weights in
    `matrix_type`, the token embedding in `embedding_type` (default: the same), norms and biases in F32. With
    `split_max_tensors`, a split set `out-00001-of-0000N.gguf`, ... of that many tensors a part (llama.cpp's
    gguf-split layout: the metadata in the first part); the first part is returned. `types`: the type of the
    tensors whose checkpoint name ends so (e.g. {"v_proj.weight": "Q8_0"}, as llama-quantize's mixes give)."""
    import gguf

    config = json.loads((hf_dir / "config.json").read_text())
    arch = GGUF_ARCHITECTURES[config["model_type"]]
    heads, kv_heads = config["num_attention_heads"], config["num_key_value_heads"]
    writer = gguf.GGUFWriter(str(out), arch, split_max_tensors=split_max_tensors)
    writer.add_block_count(config["num_hidden_layers"])
    writer.add_context_length(config["max_position_embeddings"])
    writer.add_embedding_length(config["hidden_size"])
    writer.add_feed_forward_length(config["intermediate_size"])
    writer.add_head_count(heads)
    latent = arch == gguf_deepseek.ARCH
    if latent:  # MLA's heads and widths, its experts and YaRN, as the converter writes them
        gguf_deepseek.add_metadata(writer, config)
    else:
        writer.add_head_count_kv(kv_heads)
    writer.add_layer_norm_rms_eps(config["rms_norm_eps"])
    rope = config.get("rope_parameters") or {}
    rope = rope.get("full_attention", rope)  # Gemma 3's global layers' (the file's base; the local one is implied)
    writer.add_rope_freq_base(float(config.get("rope_theta") or rope.get("rope_theta") or 10000.0))
    writer.add_vocab_size(config["vocab_size"])
    if "head_dim" in config and config["head_dim"] and not latent:
        writer.add_key_length(config["head_dim"])
        writer.add_value_length(config["head_dim"])
    gemma = arch.startswith("gemma")
    if gemma:  # as llama.cpp's converter writes them (the layers' pattern and the local rope base are implied)
        if config.get("attn_logit_softcapping"):
            writer.add_attn_logit_softcapping(config["attn_logit_softcapping"])
        if config.get("final_logit_softcapping"):
            writer.add_final_logit_softcapping(config["final_logit_softcapping"])
        writer.add_sliding_window(config["sliding_window"])
        if rope.get("rope_type") == "linear":
            writer.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
            writer.add_rope_scaling_factor(rope["factor"])
    if arch == "phi3":  # as llama.cpp's converter writes a Phi-3 (0: no sliding window, its mark of Phi-4)
        fraction = rope.get("partial_rotary_factor", 1.0)
        writer.add_rope_dimension_count(int(fraction * config["hidden_size"]) // heads)
        writer.add_sliding_window(config.get("sliding_window") or 0)
        if rope.get("rope_type") == "longrope":  # the 128k models: factors as tensors, the attention factor
            original = rope["original_max_position_embeddings"]
            writer.add_rope_scaling_orig_ctx_len(original)
            scale = config["max_position_embeddings"] / original
            writer.add_rope_scaling_attn_factors(math.sqrt(1 + math.log(scale) / math.log(original)))
            writer.add_tensor("rope_factors_long.weight", np.array(rope["long_factor"], dtype=np.float32))
            writer.add_tensor("rope_factors_short.weight", np.array(rope["short_factor"], dtype=np.float32))
    gpt_oss = arch == "gpt-oss"
    if gpt_oss:  # as llama.cpp's converter writes gpt-oss's window and YaRN
        writer.add_sliding_window(config["sliding_window"])
        writer.add_rope_scaling_type(gguf.RopeScalingType.YARN)
        writer.add_rope_scaling_factor(rope["factor"])
        writer.add_rope_scaling_orig_ctx_len(rope["original_max_position_embeddings"])
        writer.add_rope_scaling_yarn_beta_fast(rope["beta_fast"])
        writer.add_rope_scaling_yarn_beta_slow(rope["beta_slow"])
        writer.add_expert_feed_forward_length(config["intermediate_size"])
    n_experts = config.get("num_experts") or config.get("num_local_experts")
    if n_experts and not latent:  # as the converter writes a mixture's settings
        writer.add_expert_count(n_experts)
        writer.add_expert_used_count(config["num_experts_per_tok"])
        if config.get("moe_intermediate_size"):
            writer.add_expert_feed_forward_length(config["moe_intermediate_size"])
        if config.get("shared_expert_intermediate_size"):
            writer.add_expert_shared_feed_forward_length(config["shared_expert_intermediate_size"])
    _add_tokenizer(writer, hf_dir, config)
    rope_factors = llama3_rope_factors(config)
    if rope_factors is not None:  # as the converter does: its extra tensors come before the checkpoint's
        writer.add_tensor("rope_freqs.weight", rope_factors)
    tensors = load_file(str(hf_dir / "model.safetensors"))
    if config.get("tie_word_embeddings"):
        tensors.pop("lm_head.weight", None)
    if config["model_type"] == "mixtral":
        tensors = {_mixtral_name(name): tensor for name, tensor in tensors.items()}
    if latent:
        for name, values in gguf_deepseek.gguf_tensors(tensors, config).items():
            _add_tensor(writer, name, values, _fitting(matrix_type, values) if values.ndim > 1 and ".attn_" in name
                        and "_norm" not in name else "F32")
    stacks = gpt_oss_stacks(tensors) if gpt_oss else stack_experts(tensors)
    for name, values in stacks.items():  # the converter's stacks: [experts, out, in], biases [experts, out]
        _add_tensor(writer, name, values, matrix_type if values.ndim == 3 else "F32")
    for name, tensor in sorted(tensors.items()):
        values = tensor.astype(np.float32)
        if arch == "llama" and name.endswith(("q_proj.weight", "k_proj.weight")):
            values = permute_rotary_rows(values, heads if "q_proj" in name else kv_heads)
        if name.endswith("shared_expert_gate.weight") and matrix_type != "F32":
            values = values.reshape(-1)  # llama-quantize writes this one-row matrix as a float vector
        # As llama-quantize does, routers (`ffn_gate_inp`) stay float.
        kind = "F32" if values.ndim == 1 or name.endswith("mlp.gate.weight") else \
            (embedding_type or matrix_type) if "embed" in name else matrix_type
        if gemma and name.endswith("norm.weight"):
            values = values + np.float32(1)
        kind = "F32" if name.endswith("mlp.router.weight") else kind
        kind = next((t for suffix, t in (types or {}).items() if name.endswith(suffix)), kind)
        _add_tensor(writer, gguf_name(name, gemma, gpt_oss), values, kind)
    first = writer.format_shard_names(out)[0]
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return first


def _mixtral_name(name: str) -> str:
    for old, new in _MIXTRAL_NAMES.items():
        name = name.replace(old, new)
    return name


def stack_experts(tensors: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """Pop every expert's matrices from `tensors`; return them stacked per layer and projection under their GGUF
    names (`blk.N.ffn_gate_exps.weight`, [experts, out, in]), as llama.cpp's converter writes them."""
    found: dict[tuple[int, str], dict[int, np.ndarray]] = {}
    for name in [n for n in tensors if _EXPERT.match(n)]:
        layer, expert, projection = _EXPERT.match(name).groups()
        found.setdefault((int(layer), projection), {})[int(expert)] = tensors.pop(name).astype(np.float32)
    return {f"blk.{layer}.ffn_{projection}_exps.weight": np.stack([by[e] for e in sorted(by)])
            for (layer, projection), by in sorted(found.items())}


def _fitting(kind: str, values: np.ndarray) -> str:
    """`kind`, or F32 for a matrix whose rows are not whole blocks of it (llama-quantize leaves those so)."""
    import gguf

    block = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType[kind]][0]
    return kind if values.shape[-1] % block == 0 else "F32"


def gpt_oss_stacks(tensors: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """Pop gpt-oss's experts ([experts, in, out], gate and up columns interleaved, biases beside) from `tensors`;
    return them as llama.cpp's converter writes them: gate, up and down stacks [experts, out, in] and their
    biases [experts, out]."""
    stacks: dict[str, np.ndarray] = {}
    for name in sorted(n for n in tensors if ".mlp.experts." in n):
        layer, leaf = int(name.split(".")[2]), name.rpartition(".")[2]
        values = tensors.pop(name).astype(np.float32)
        block = f"blk.{layer}"
        if leaf == "gate_up_proj":
            stacks[f"{block}.ffn_gate_exps.weight"] = np.ascontiguousarray(values[..., 0::2].swapaxes(1, 2))
            stacks[f"{block}.ffn_up_exps.weight"] = np.ascontiguousarray(values[..., 1::2].swapaxes(1, 2))
        elif leaf == "gate_up_proj_bias":
            stacks[f"{block}.ffn_gate_exps.bias"] = np.ascontiguousarray(values[..., 0::2])
            stacks[f"{block}.ffn_up_exps.bias"] = np.ascontiguousarray(values[..., 1::2])
        elif leaf == "down_proj":
            stacks[f"{block}.ffn_down_exps.weight"] = np.ascontiguousarray(values.swapaxes(1, 2))
        else:
            stacks[f"{block}.ffn_down_exps.bias"] = values
    return stacks


def _add_tensor(writer, name: str, values: np.ndarray, kind: str) -> None:  # noqa: ANN001
    import gguf

    if kind == "F32":
        writer.add_tensor(name, values)
    elif kind == "F16":
        writer.add_tensor(name, values.astype(np.float16))
    elif kind in K_QUANTIZERS:  # types gguf cannot quantize: blocks from the simple quantizers below
        qtype = gguf.GGMLQuantizationType[kind]
        rows = K_QUANTIZERS[kind](values.reshape(-1, values.shape[-1]))
        writer.add_tensor(name, rows.reshape(*values.shape[:-1], -1), raw_dtype=qtype)
    else:
        qtype = gguf.GGMLQuantizationType[kind]
        writer.add_tensor(name, gguf.quants.quantize(values, qtype), raw_dtype=qtype)


# -- K-quants ------------------------------------------------------------------------------------------------------
# gguf's Python package reads Q4_K, Q5_K and Q6_K but cannot write them. These quantizers write valid blocks
# in ggml's layouts (see exo_like/models/gguf/blocks.py) from plain min/max rounding: simpler than llama.cpp's
# error-minimising search, so the values differ from what llama-quantize would pick, but every field is real
# and the file dequantizes close to the float weights. Rows must be a multiple of 256 long.


def _f16_bytes(values: np.ndarray) -> np.ndarray:
    return values.astype(np.float16).view(np.uint8).reshape(values.shape[0], 2)


def _pack_k_scales(scales: np.ndarray, mins: np.ndarray) -> np.ndarray:
    """Eight 6-bit scales and mins per superblock [blocks, 8] -> ggml's 12-byte packing."""
    low = (scales[:, :4] & 0x3F) | ((scales[:, 4:] >> 4) << 6)
    mid = (mins[:, :4] & 0x3F) | ((mins[:, 4:] >> 4) << 6)
    high = (scales[:, 4:] & 0x0F) | ((mins[:, 4:] & 0x0F) << 4)
    return np.concatenate([low, mid, high], axis=1).astype(np.uint8)


def _affine_k(values: np.ndarray, levels: int) -> tuple[np.ndarray, ...]:
    """Superblocks of 256 in groups of 32: w ~ d * scale * q - dmin * min with 6-bit scale and min."""
    groups = values.reshape(-1, 8, 32).astype(np.float32)
    low = np.minimum(groups.min(-1), 0)
    step = (groups.max(-1) - low) / (levels - 1)
    d = np.maximum(step.max(-1), 1e-8) / 63
    dmin = np.maximum(-low.min(-1), 1e-8) / 63
    d, dmin = d.astype(np.float16).astype(np.float32), dmin.astype(np.float16).astype(np.float32)
    scales = np.clip(np.round(step / d[:, None]), 1, 63).astype(np.uint8)
    mins = np.clip(np.round(-low / dmin[:, None]), 0, 63).astype(np.uint8)
    group_scale = (d[:, None] * scales)[..., None]
    group_min = (dmin[:, None] * mins)[..., None]
    q = np.clip(np.round((groups + group_min) / group_scale), 0, levels - 1).astype(np.uint8)
    return d, dmin, scales, mins, q


def _k_nibbles(q: np.ndarray) -> np.ndarray:
    """[blocks, 8, 32] codes -> 128 bytes: run i holds group 2i in low nibbles, group 2i + 1 in high ones."""
    low = q[:, 0::2] & 0x0F
    high = q[:, 1::2] & 0x0F
    return (low | (high << 4)).reshape(q.shape[0], 128)


def quantize_q4_k(values: np.ndarray) -> np.ndarray:
    rows = values.shape[0]
    d, dmin, scales, mins, q = _affine_k(values, 16)
    blocks = np.concatenate([_f16_bytes(d), _f16_bytes(dmin), _pack_k_scales(scales, mins), _k_nibbles(q)], axis=1)
    return blocks.reshape(rows, -1)


def quantize_q5_k(values: np.ndarray) -> np.ndarray:
    rows = values.shape[0]
    d, dmin, scales, mins, q = _affine_k(values, 32)
    fifth = (q >> 4) & 1  # [blocks, 8, 32]: bit g of byte j is group g's value j
    high = (fifth << np.arange(8, dtype=np.uint8)[None, :, None]).sum(1, dtype=np.uint8)
    blocks = np.concatenate([_f16_bytes(d), _f16_bytes(dmin), _pack_k_scales(scales, mins), high, _k_nibbles(q)],
                            axis=1)
    return blocks.reshape(rows, -1)


def quantize_q6_k(values: np.ndarray) -> np.ndarray:
    """Superblocks of 256 in groups of 16: w ~ d * scale * (q - 32), int8 scale, 6-bit q."""
    rows = values.shape[0]
    groups = values.reshape(-1, 16, 16).astype(np.float32)
    step = np.maximum(np.abs(groups).max(-1) / 31, 1e-8)
    d = (step.max(-1) / 127).astype(np.float16).astype(np.float32)
    scales = np.clip(np.round(step / d[:, None]), 1, 127).astype(np.int8)
    q = np.clip(np.round(groups / (d[:, None] * scales)[..., None]) + 32, 0, 63).astype(np.uint8).reshape(-1, 256)
    # Element h*128 + r: low nibble in nibble r // 64 of ql[h*64 + r % 64]; high 2 bits at bits 2*(r // 32) of
    # qh[h*32 + r % 32].
    halves = q.reshape(-1, 2, 128)
    ql = (halves[..., :64] & 0x0F) | ((halves[..., 64:] & 0x0F) << 4)
    top = (halves >> 4).reshape(-1, 2, 4, 32)
    qh = (top << (2 * np.arange(4, dtype=np.uint8))[None, None, :, None]).sum(2, dtype=np.uint8)
    blocks = np.concatenate([ql.reshape(-1, 128), qh.reshape(-1, 64), scales.view(np.uint8), _f16_bytes(d)], axis=1)
    return blocks.reshape(rows, -1)


K_QUANTIZERS = {"Q4_K": quantize_q4_k, "Q5_K": quantize_q5_k, "Q6_K": quantize_q6_k}


def _add_tokenizer(writer, hf_dir: Path, config: dict) -> None:  # noqa: ANN001
    tokenizer = json.loads((hf_dir / "tokenizer.json").read_text())
    vocab = tokenizer["model"]["vocab"]
    added = {t["id"]: t["content"] for t in tokenizer["added_tokens"]}
    tokens = [""] * config["vocab_size"]
    for token, index in vocab.items():
        tokens[index] = token
    for index, token in added.items():
        tokens[index] = token
    merges = [m if isinstance(m, str) else " ".join(m) for m in tokenizer["model"]["merges"]]
    tokenizer_config = json.loads((hf_dir / "tokenizer_config.json").read_text())
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("default")
    writer.add_token_list(tokens)
    writer.add_token_types([3 if i in added else 1 for i in range(len(tokens))])
    writer.add_token_merges(merges)
    ids = {token: index for index, token in enumerate(tokens)}
    writer.add_bos_token_id(ids[tokenizer_config["bos_token"]])
    writer.add_eos_token_id(ids[tokenizer_config["eos_token"]])
    writer.add_add_bos_token(True)
    writer.add_chat_template(tokenizer_config["chat_template"])


def hf_tensors_from_gguf(path: Path, config_dir: Path) -> dict[str, "torch.Tensor"]:  # noqa: F821
    """The inverse of write_gguf, through gguf's own reader and dequantizer: each tensor under the name the
    checkpoint in `config_dir` gives it, float32."""
    import gguf
    import torch

    config = json.loads((config_dir / "config.json").read_text())
    heads, kv_heads = config["num_attention_heads"], config["num_key_value_heads"]
    to_hf = {v: k for k, v in _LAYER_PARTS.items()}
    if config["model_type"] == "phi3":
        to_hf.update({v: k for k, v in _PHI3_PARTS.items()})
    gemma = config["model_type"].startswith("gemma")
    if gemma:
        to_hf.update({v: k for k, v in _GEMMA_PARTS.items()})
    gpt_oss = config["model_type"] == "gpt_oss"
    if gpt_oss:
        to_hf.update({v: k for k, v in _GPT_OSS_PARTS.items()})
    globals_to_hf = {"token_embd.weight": "model.embed_tokens.weight", "output_norm.weight": "model.norm.weight",
                     "output.weight": "lm_head.weight"}
    tensors: dict[str, np.ndarray] = {}
    for tensor in gguf.GGUFReader(str(path)).tensors:
        shape = tuple(int(d) for d in reversed(tensor.shape))
        values = gguf.quants.dequantize(tensor.data, tensor.tensor_type).astype(np.float32).reshape(shape)
        if tensor.name in ("rope_freqs.weight", "rope_factors_long.weight", "rope_factors_short.weight"):
            continue  # the model's rope settings, not weights
        if tensor.name in globals_to_hf:
            if config["model_type"].startswith("gemma") and tensor.name == "output_norm.weight":
                values = values - np.float32(1)
            tensors[globals_to_hf[tensor.name]] = values
            continue
        _, layer, part = tensor.name.split(".", 2)
        stacked = re.fullmatch(r"ffn_(gate|up|down)_exps\.(weight|bias)", part)
        if stacked and gpt_oss:
            tensors[f"blk.{layer}.{part}"] = values  # joined into the checkpoint's stacks below
            continue
        if stacked:
            for expert, matrix in enumerate(values):
                tensors[f"model.layers.{layer}.mlp.experts.{expert}.{stacked.group(1)}_proj.weight"] = matrix
            continue
        if part == "ffn_gate_inp_shexp.weight":
            values = values.reshape(1, -1)  # one output; llama-quantize may store it as a vector
        if gguf_deepseek.is_latent_part(part) and GGUF_ARCHITECTURES[config["model_type"]] == gguf_deepseek.ARCH:
            tensors[tensor.name] = values  # named (and kv_b joined) by gguf_deepseek.hf_tensors below
            continue
        name = f"model.layers.{layer}.{to_hf[part]}"
        if gemma and name.endswith("norm.weight"):
            values = values - np.float32(1)
        if GGUF_ARCHITECTURES[config["model_type"]] == "llama" and name.endswith(("q_proj.weight", "k_proj.weight")):
            n = heads if "q_proj" in name else kv_heads
            half = values.shape[0] // n // 2
            values = values.reshape(n, half, 2, -1).swapaxes(1, 2).reshape(values.shape)
        tensors[name] = values
    if config["model_type"] == "mixtral":
        inverse = {v: k for k, v in _MIXTRAL_NAMES.items()}
        renamed = {}
        for name, values in tensors.items():
            for new, old in sorted(inverse.items(), key=lambda kv: -len(kv[0])):
                name = name.replace(new, old)
            renamed[name] = values
        tensors = renamed
    if gpt_oss:
        tensors = _gpt_oss_experts(tensors, config["num_hidden_layers"])
    tensors.update(gguf_deepseek.hf_tensors(tensors))
    if config.get("tie_word_embeddings"):
        tensors.pop("lm_head.weight", None)
    return {name: torch.from_numpy(np.ascontiguousarray(values)) for name, values in tensors.items()}


def _gpt_oss_experts(tensors: dict[str, np.ndarray], n_layers: int) -> dict[str, np.ndarray]:
    """gpt_oss_stacks' inverse: the GGUF stacks back into the checkpoint's [experts, in, out] interleaved ones."""
    for layer in range(n_layers):
        stack = {f"{p}.{k}": tensors.pop(f"blk.{layer}.ffn_{p}_exps.{k}") for p in ("gate", "up", "down")
                 for k in ("weight", "bias")}
        prefix = f"model.layers.{layer}.mlp.experts"
        gate, up = stack["gate.weight"].swapaxes(1, 2), stack["up.weight"].swapaxes(1, 2)
        gate_up = np.empty((*gate.shape[:2], 2 * gate.shape[2]), dtype=np.float32)
        gate_up[..., 0::2], gate_up[..., 1::2] = gate, up
        bias = np.empty((gate.shape[0], 2 * gate.shape[2]), dtype=np.float32)
        bias[:, 0::2], bias[:, 1::2] = stack["gate.bias"], stack["up.bias"]
        tensors.update({f"{prefix}.gate_up_proj": gate_up, f"{prefix}.gate_up_proj_bias": bias,
                        f"{prefix}.down_proj": stack["down.weight"].swapaxes(1, 2),
                        f"{prefix}.down_proj_bias": stack["down.bias"]})
    return tensors
