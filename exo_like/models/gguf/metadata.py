"""A GGUF file's metadata in `config.json`'s terms (what ModelArgs.from_dict reads), per architecture: the keys
llama.cpp's converter writes, what its graphs take as given for some models (Gemma's layer pattern and query
scale), and the config tensors (llama3's `rope_freqs`, LongRoPE's factors). A mixin of GGUFCheckpoint (file.py),
which holds the metadata, the tensor table and the reader."""

from __future__ import annotations

from functools import cached_property
from pathlib import Path
from typing import Any


from exo_like.errors import UnsupportedModelError
from exo_like.models.gguf import deepseek

# GGUF's `general.architecture` -> the model_type the engines implement (Mistral files say "llama"; Mixtral's
# say "llama" too, with experts).
ARCHITECTURES = {"llama": "llama", "qwen2": "qwen2", "qwen3": "qwen3", "qwen2moe": "qwen2_moe",
                 "qwen3moe": "qwen3_moe", "phi3": "phi3", "gemma2": "gemma2", "gemma3": "gemma3_text",
                 "gpt-oss": "gpt_oss", deepseek.ARCHITECTURE: "deepseek_v3"}
# What llama.cpp's Gemma graphs take as given rather than from the metadata: the layers' pattern (Gemma 2 alternates
# sliding and full attention, Gemma 3 has five sliding layers to one full), and the queries' scale: 1/sqrt(head_dim),
# but 1/sqrt(hidden / heads) for the 27B models (46 layers for Gemma 2, 62 for Gemma 3).
_GEMMA_PATTERN = {"gemma2": 2, "gemma3": 6}
_GEMMA_27B_LAYERS = {"gemma2": 46, "gemma3": 62}
# Whether llama.cpp renormalises the top-k router weights, per architecture, when the file does not say
# (`expert_weights_norm`): its qwen3moe graph always does, its qwen2moe graph never, Mixtral always.
_RENORMALIZED = {"qwen2moe": False, "qwen3moe": True, "llama": True, "gpt-oss": False,
                 deepseek.ARCHITECTURE: False}
# Per-dimension rotary frequency factors: part of the model's config (read while planning, see _rope_scaling),
# not of any shard's weights. Kept under its GGUF name.
ROPE_FREQS = "rope_freqs.weight"
# Phi-3's LongRoPE factors (its 128k-context models), also the model's config.
ROPE_FACTORS = ("rope_factors_long.weight", "rope_factors_short.weight")
# Tensors a node reads while planning, from the header's tensor table (gguf_hub.py fetches them with the header).
CONFIG_TENSORS = (ROPE_FREQS, *ROPE_FACTORS)


class ConfigFromMetadata:
    """Needs from its class: `path`, `metadata`, `architecture`, `tensors` (HF name -> entry), `_stored`,
    `read(name)` and `config_heads`."""

    path: Path
    metadata: dict[str, Any]
    architecture: str

    def _key(self, name: str, default: Any = None) -> Any:
        return self.metadata.get(f"{self.architecture}.{name}", default)

    def config(self) -> dict[str, Any]:
        """The model's hyper-parameters in `config.json`'s terms (what ModelArgs.from_dict reads)."""
        heads = int(self._key("attention.head_count"))
        hidden = int(self._key("embedding_length"))
        tokens = self.metadata.get("tokenizer.ggml.tokens")
        embedding = self.tensors["model.embed_tokens.weight"]
        config: dict[str, Any] = {
            "model_type": self.model_type,
            "hidden_size": hidden,
            "num_hidden_layers": int(self._key("block_count")),
            "num_attention_heads": heads,
            "num_key_value_heads": int(self._key("attention.head_count_kv", heads)),
            "head_dim": int(self._key("attention.key_length", hidden // heads)),
            "intermediate_size": int(self._key("feed_forward_length") or self._key("expert_feed_forward_length")),
            "vocab_size": int(self._key("vocab_size", len(tokens) if tokens else embedding.shape[0])),
            "rms_norm_eps": float(self._key("attention.layer_norm_rms_epsilon", 1e-6)),
            "rope_theta": float(self._key("rope.freq_base", 10000.0)),
            "max_position_embeddings": int(self._key("context_length", 4096)),
            "tie_word_embeddings": "lm_head.weight" not in self.tensors,
            "attention_bias": "model.layers.0.self_attn.q_proj.bias" in self.tensors,
            "torch_dtype": self._float_dtype(),
            "bos_token_id": self.metadata.get("tokenizer.ggml.bos_token_id"),
            "eos_token_id": self._stop_ids(),
        }
        config.update(self._rope_scaling())
        config.update(self._experts())
        window = int(self._key("attention.sliding_window", 0) or 0)
        if window:  # 0: none (how llama.cpp's converter marks Phi-4 among phi3 files)
            config["sliding_window"] = window
        if self.architecture in _GEMMA_PATTERN:
            config.update(self._gemma())
        if self.architecture == deepseek.ARCHITECTURE:
            config.update(deepseek.config(self._key, heads))
            mscales = {key: config.pop(key) for key in ("mscale", "mscale_all_dim") if key in config}
            if "rope_scaling" in config:
                config["rope_scaling"].update(mscales)
        rope_dims = self._key("rope.dimension_count")
        if rope_dims is not None and int(rope_dims) != config["head_dim"]:
            config["partial_rotary_factor"] = int(rope_dims) / config["head_dim"]
        return config

    @cached_property
    def model_type(self) -> str:
        if self.architecture == "llama" and int(self._key("expert_count", 0)):
            return "mixtral"
        if self.architecture == deepseek.ARCHITECTURE:
            return deepseek.model_type(self._key, [entry.gguf_name for entry in self._stored])
        return ARCHITECTURES[self.architecture]

    def _experts(self) -> dict[str, Any]:
        """A mixture's settings in the config's terms; layers without a router are dense (`mlp_only_layers`)."""
        n_experts = int(self._key("expert_count", 0))
        if not n_experts:
            return {}
        n_layers = int(self._key("block_count"))
        settings: dict[str, Any] = {
            "num_experts": n_experts,
            "num_local_experts": n_experts,
            "num_experts_per_tok": int(self._key("expert_used_count")),
            "norm_topk_prob": bool(self._key("expert_weights_norm", _RENORMALIZED[self.architecture])),
            "mlp_only_layers": [i for i in range(n_layers) if f"model.layers.{i}.mlp.gate.weight" not in self.tensors],
        }
        expert_size = self._key("expert_feed_forward_length")
        if expert_size is not None:
            settings["moe_intermediate_size"] = int(expert_size)
        shared_size = self._key("expert_shared_feed_forward_length")
        if shared_size is not None:
            settings["shared_expert_intermediate_size"] = int(shared_size)
        return settings

    def _rope_scaling(self) -> dict[str, Any]:
        """The metadata's rope scaling, and the per-dimension frequency factors of a `rope_freqs` tensor.

        llama.cpp's converter stores Llama 3.1/3.2's llama3 scaling only as that tensor (no metadata names it or
        its parameters), and llama.cpp divides each rotary frequency by its factor: so the tensor is what the
        model's rope is, and it reaches the engines through the config (ModelArgs.rope_freq_factors)."""
        settings: dict[str, Any] = {}
        if ROPE_FREQS in self.tensors:
            settings["rope_freq_factors"] = self.read(ROPE_FREQS).reshape(-1).tolist()
        if all(name in self.tensors for name in ROPE_FACTORS):  # Phi-3's LongRoPE (its 128k models)
            return {**settings, "rope_scaling": self._longrope()}
        kind = self._key("rope.scaling.type", "none")
        if kind in ("none", None):
            return settings
        if kind == "linear":
            return {**settings,
                    "rope_scaling": {"rope_type": "linear", "factor": float(self._key("rope.scaling.factor"))}}
        if kind == "yarn":
            return {**settings, "rope_scaling": self._yarn()}
        raise UnsupportedModelError(f"{self.path.name}: rope scaling {kind!r} is not supported; supported: linear, "
                                    "yarn", code="unsupported_rope_scaling")

    def _longrope(self) -> dict[str, Any]:
        long, short = (self.read(name).reshape(-1).tolist() for name in ROPE_FACTORS)
        scaling = {"rope_type": "longrope", "long_factor": long, "short_factor": short,
                   "original_max_position_embeddings": int(self._key("rope.scaling.original_context_length", 4096))}
        if self._key("rope.scaling.attn_factor") is not None:
            scaling["attention_factor"] = float(self._key("rope.scaling.attn_factor"))
        return scaling

    def _yarn(self) -> dict[str, Any]:
        """YaRN as the converter stores it. Whether the ramp's ends are rounded to whole dimensions (transformers'
        `truncate`) is not stored: gpt-oss was trained without, the other yarn models (Qwen2.5) with."""
        original = int(self._key("rope.scaling.original_context_length"))
        yarn: dict[str, Any] = {"rope_type": "yarn", "factor": float(self._key("rope.scaling.factor")),
                                "original_max_position_embeddings": original,
                                "truncate": self.architecture != "gpt-oss"}
        for key, name in (("yarn_beta_fast", "beta_fast"), ("yarn_beta_slow", "beta_slow"),
                          ("yarn_attn_factor", "attention_factor")):
            if self._key(f"rope.scaling.{key}") is not None:
                yarn[name] = float(self._key(f"rope.scaling.{key}"))
        return yarn

    def _gemma(self) -> dict[str, Any]:
        layers, hidden, heads = int(self._key("block_count")), int(self._key("embedding_length")), self.config_heads
        big = layers == _GEMMA_27B_LAYERS[self.architecture]
        settings = {"sliding_window_pattern": _GEMMA_PATTERN[self.architecture],
                    "query_pre_attn_scalar": hidden // heads if big else int(self._key("attention.key_length")),
                    "attn_logit_softcapping": self._key("attn_logit_softcapping"),
                    "final_logit_softcapping": self._key("final_logit_softcapping"),
                    "tie_word_embeddings": "lm_head.weight" not in self.tensors}
        if self.architecture == "gemma3":
            settings["rope_local_base_freq"] = 10000.0  # llama.cpp's, for the sliding layers
        return settings

    def _stop_ids(self) -> list[int]:
        """llama.cpp stops at any end-of-generation token: end of sequence, end of turn, end of message."""
        keys = ("eos_token_id", "eot_token_id", "eom_token_id")
        ids = [self.metadata.get(f"tokenizer.ggml.{key}") for key in keys]
        return list(dict.fromkeys(int(i) for i in ids if i is not None))

    def _float_dtype(self) -> str:
        """The float dtype the model's matrices are stored in; for quantized ones, bfloat16: the dtype an MLX
        node (or a torch node off CPU) runs them with (a float --dtype asks for the dequantized path instead)."""
        kinds = {entry.type_name for entry in self.tensors.values() if len(entry.shape) == 2}
        if kinds == {"BF16"}:
            return "bfloat16"
        if kinds <= {"F16", "F32"} and "F16" in kinds:
            return "float16"
        return "float32" if kinds <= {"F32"} else "bfloat16"

