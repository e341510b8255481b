"""Random GGUF checkpoints for the tests, written with `gguf`'s own writer from the tests' Hugging Face folders.

The tensors are laid out as llama.cpp's converter writes them (its names; for the llama architecture the query
and key rows reordered for its rotary embedding), the tokenizer is the folder's byte-level BPE as a `gpt2`
vocabulary, and each matrix is stored in the tensor type asked for (quantized with `gguf.quants`).
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
from safetensors.numpy import load_file

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


def gguf_name(hf_name: str) -> str:
    if hf_name.startswith("model.layers."):
        _, _, layer, rest = hf_name.split(".", 3)
        return f"blk.{layer}.{_LAYER_PARTS[rest]}"
    return {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
            "lm_head.weight": "output.weight"}[hf_name]


def permute_rotary_rows(weight: np.ndarray, n_heads: int) -> np.ndarray:
    """What llama.cpp's converter does to llama query/key rows (pairs (i, i + d/2) of each head side by side)."""
    half = weight.shape[0] // n_heads // 2
    return weight.reshape(n_heads, 2, half, *weight.shape[1:]).swapaxes(1, 2).reshape(weight.shape)


def write_gguf(hf_dir: Path, out: Path, matrix_type: str = "F32", embedding_type: str | None = None) -> Path:
    """`hf_dir` (a tests/checkpoints.py folder, float32, llama or qwen2) as one GGUF file: 2-D weights in
    `matrix_type`, the token embedding in `embedding_type` (default: the same), norms and biases in F32."""
    import gguf

    config = json.loads((hf_dir / "config.json").read_text())
    arch = config["model_type"]
    heads, kv_heads = config["num_attention_heads"], config["num_key_value_heads"]
    writer = gguf.GGUFWriter(str(out), arch)
    writer.add_block_count(config["num_hidden_layers"])
    writer.add_context_length(config["max_position_embeddings"])
    writer.add_embedding_length(config["hidden_size"])
    writer.add_feed_forward_length(config["intermediate_size"])
    writer.add_head_count(heads)
    writer.add_head_count_kv(kv_heads)
    writer.add_layer_norm_rms_eps(config["rms_norm_eps"])
    rope = config.get("rope_parameters") or {}
    writer.add_rope_freq_base(float(config.get("rope_theta") or rope.get("rope_theta") or 10000.0))
    writer.add_vocab_size(config["vocab_size"])
    _add_tokenizer(writer, hf_dir, config)
    tensors = load_file(str(hf_dir / "model.safetensors"))
    if config.get("tie_word_embeddings"):
        tensors.pop("lm_head.weight", None)
    for name, tensor in sorted(tensors.items()):
        values = tensor.astype(np.float32)
        if arch == "llama" and name.endswith(("q_proj.weight", "k_proj.weight")):
            values = permute_rotary_rows(values, heads if "q_proj" in name else kv_heads)
        kind = "F32" if values.ndim == 1 else (embedding_type or matrix_type) if "embed" in name else matrix_type
        _add_tensor(writer, gguf_name(name), values, kind)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return out


def _add_tensor(writer, name: str, values: np.ndarray, kind: str) -> None:  # noqa: ANN001
    import gguf

    if kind == "F32":
        writer.add_tensor(name, values)
    elif kind == "F16":
        writer.add_tensor(name, values.astype(np.float16))
    else:
        qtype = gguf.GGMLQuantizationType[kind]
        writer.add_tensor(name, gguf.quants.quantize(values, qtype), raw_dtype=qtype)


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
