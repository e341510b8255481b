"""The built-in `demo` model: a small random Llama checkpoint with a real byte-level BPE tokenizer.

Generated deterministically into the node's home folder on first use, without network access. Its weights are
random (UNTRAINED): it produces fluent-looking gibberish, which is enough to exercise the whole system.
The tokenizer builder is also what the tests use for their random checkpoints.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import tempfile
from pathlib import Path

import numpy as np
from safetensors.numpy import save_file
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

log = logging.getLogger(__name__)

DEMO_NAME = "demo"
DEMO_VERSION = 1  # bump when the recipe changes so old folders are regenerated

BOS, EOS, EOT = "<|begin_of_text|>", "<|end_of_text|>", "<|eot_id|>"
HEADER_START, HEADER_END = "<|start_header_id|>", "<|end_header_id|>"
SPECIAL_TOKENS = [BOS, EOS, EOT, HEADER_START, HEADER_END]

# Llama-3 style chat template, in Hugging Face's conventions (messages, add_generation_prompt, bos_token).
CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "{% if message['role'] not in ['system', 'user', 'assistant'] %}"
    "{{ raise_exception('Unknown role: ' + message['role']) }}"
    "{% endif %}"
    "<|start_header_id|>{{ message['role'] }}<|end_header_id|>\n\n{{ message['content'] | trim }}<|eot_id|>"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>\n\n{% endif %}"
)

_CORPUS = """\
The quick brown fox jumps over the lazy dog. A cluster of small machines can run one large language model
when each machine holds a contiguous range of layers. Tokens flow through the stages of the ring, and the last
stage samples the next token. Hello, world! How are you today? I am fine, thank you. What is the capital of
France? Paris is the capital of France. Numbers: 0 1 2 3 4 5 6 7 8 9 10 42 100 2024 3.14159.
def main():\n    print("hello")\n    return 0\n
Unicode text: café, naïve, façade, 日本語, 中文, русский, ελληνικά, emoji 🙂🚀✨, symbols ±×÷≠≤≥→.
Memory bandwidth bounds decoding; prefill is bound by compute. Peer to peer, zero configuration, mDNS.
"""


def build_tokenizer(vocab_size: int = 1024) -> Tokenizer:
    """Train a byte-level BPE on a built-in corpus. Deterministic: same input, same merges."""
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator([_CORPUS] * 4, trainer=trainer)
    bos_id = tokenizer.token_to_id(BOS)
    tokenizer.post_processor = processors.TemplateProcessing(
        single=f"{BOS} $A", pair=f"{BOS} $A {BOS} $B", special_tokens=[(BOS, bos_id)]
    )
    return tokenizer


def write_tokenizer_files(model_dir: Path, tokenizer: Tokenizer) -> dict[str, int]:
    """Write tokenizer.json and tokenizer_config.json (with chat template); return the special token ids."""
    tokenizer.save(str(model_dir / "tokenizer.json"))
    ids = {token: tokenizer.token_to_id(token) for token in SPECIAL_TOKENS}
    tokenizer_config = {
        "bos_token": BOS,
        "eos_token": EOT,
        "chat_template": CHAT_TEMPLATE,
        "model_max_length": 4096,
        "added_tokens_decoder": {
            str(ids[t]): {"content": t, "special": True, "lstrip": False, "rstrip": False, "normalized": False,
                          "single_word": False}
            for t in SPECIAL_TOKENS
        },
        "tokenizer_class": "PreTrainedTokenizerFast",
    }
    (model_dir / "tokenizer_config.json").write_text(json.dumps(tokenizer_config, indent=2))
    (model_dir / "special_tokens_map.json").write_text(json.dumps({"bos_token": BOS, "eos_token": EOT}))
    return ids


DEMO_CONFIG = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_size": 256,
    "intermediate_size": 704,
    "num_hidden_layers": 8,
    "num_attention_heads": 8,
    "num_key_value_heads": 4,
    "head_dim": 32,
    "rms_norm_eps": 1e-5,
    "rope_theta": 500000.0,
    "max_position_embeddings": 4096,
    "tie_word_embeddings": True,
    "hidden_act": "silu",
    "torch_dtype": "float32",
    "exo_like_note": "UNTRAINED random weights, generated locally by exo-like for demos and tests",
}


def random_llama_weights(config: dict, rng: np.random.Generator) -> dict[str, np.ndarray]:
    """Weights scaled so logits are peaky (std ~ 1.5/sqrt(fan_in), norms ~ 1 +- 0.1)."""
    hidden, inter = config["hidden_size"], config["intermediate_size"]
    head_dim, heads, kv_heads = config["head_dim"], config["num_attention_heads"], config["num_key_value_heads"]

    def linear(out_features: int, in_features: int) -> np.ndarray:
        return (rng.standard_normal((out_features, in_features)) * 1.5 / np.sqrt(in_features)).astype(np.float32)

    def norm(size: int) -> np.ndarray:
        return (1.0 + rng.uniform(-0.1, 0.1, size)).astype(np.float32)

    weights = {"model.embed_tokens.weight": rng.standard_normal((config["vocab_size"], hidden)).astype(np.float32)}
    for i in range(config["num_hidden_layers"]):
        p = f"model.layers.{i}."
        weights[p + "self_attn.q_proj.weight"] = linear(heads * head_dim, hidden)
        weights[p + "self_attn.k_proj.weight"] = linear(kv_heads * head_dim, hidden)
        weights[p + "self_attn.v_proj.weight"] = linear(kv_heads * head_dim, hidden)
        weights[p + "self_attn.o_proj.weight"] = linear(hidden, heads * head_dim)
        weights[p + "mlp.gate_proj.weight"] = linear(inter, hidden)
        weights[p + "mlp.up_proj.weight"] = linear(inter, hidden)
        weights[p + "mlp.down_proj.weight"] = linear(hidden, inter)
        weights[p + "input_layernorm.weight"] = norm(hidden)
        weights[p + "post_attention_layernorm.weight"] = norm(hidden)
    weights["model.norm.weight"] = norm(hidden)
    return weights


def demo_model_dir(home: Path) -> Path:
    return home / "models" / DEMO_NAME


def ensure_demo_model(home: Path) -> Path:
    """Return the demo model folder, generating it first if missing or from an older recipe."""
    target = demo_model_dir(home)
    marker = target / "exo_like_demo.json"
    if marker.exists() and json.loads(marker.read_text()).get("version") == DEMO_VERSION:
        return target
    log.info("generating the untrained demo model into %s", target)
    target.parent.mkdir(parents=True, exist_ok=True)
    # Build in a temporary sibling and rename, so a crash never leaves a half-written model behind.
    staging = Path(tempfile.mkdtemp(prefix=".demo-", dir=target.parent))
    try:
        _write_demo(staging)
        shutil.rmtree(target, ignore_errors=True)
        os.replace(staging, target)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return target


def _write_demo(model_dir: Path) -> None:
    tokenizer = build_tokenizer()
    ids = write_tokenizer_files(model_dir, tokenizer)
    config = dict(DEMO_CONFIG, vocab_size=tokenizer.get_vocab_size(), bos_token_id=ids[BOS],
                  eos_token_id=[ids[EOT], ids[EOS]])
    (model_dir / "config.json").write_text(json.dumps(config, indent=2))
    (model_dir / "generation_config.json").write_text(
        json.dumps({"bos_token_id": ids[BOS], "eos_token_id": [ids[EOT], ids[EOS]]})
    )
    weights = random_llama_weights(config, np.random.default_rng(20241121))
    save_file(weights, str(model_dir / "model.safetensors"), metadata={"format": "pt"})
    (model_dir / "exo_like_demo.json").write_text(json.dumps({"version": DEMO_VERSION, "untrained": True}))
