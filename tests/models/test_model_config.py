"""ModelArgs from config.json: both rope conventions, per-architecture quirks, clear errors."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from exo_like.errors import UnsupportedModelError
from exo_like.models.config import ModelArgs, rope_inv_freq
from tests.checkpoints import ARCHITECTURES, hf_config

TOKEN_IDS = {"<|begin_of_text|>": 0, "<|eot_id|>": 2}


def config_dict(arch: str, **overrides) -> dict:
    return hf_config(arch, 2, 300, TOKEN_IDS, **overrides).to_dict()


@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_inv_freq_matches_transformers(arch: str) -> None:
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    config = hf_config(arch, 2, 300, TOKEN_IDS)
    rope_type = config.rope_parameters.get("rope_type", "default")
    if rope_type == "default":
        from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

        expected, _ = LlamaRotaryEmbedding.compute_default_rope_parameters(config)
    else:
        expected, _ = ROPE_INIT_FUNCTIONS[rope_type](config, "cpu")
    actual = rope_inv_freq(ModelArgs.from_dict(config.to_dict()))
    np.testing.assert_allclose(actual, expected.numpy(), rtol=1e-6)


def test_hub_and_transformers5_rope_conventions_agree() -> None:
    new_style = config_dict("llama")
    hub_style = {k: v for k, v in new_style.items() if k != "rope_parameters"}
    rope = dict(new_style["rope_parameters"])
    hub_style["rope_theta"] = rope.pop("rope_theta")
    hub_style["rope_scaling"] = {**rope, "type": rope.pop("rope_type")}  # older checkpoints say "type"
    assert ModelArgs.from_dict(new_style) == ModelArgs.from_dict(hub_style)
    assert ModelArgs.from_dict(hub_style).rope_scaling["rope_type"] == "llama3"


def test_architecture_quirks() -> None:
    qwen2 = ModelArgs.from_dict(config_dict("qwen2"))
    assert qwen2.qkv_bias and not qwen2.o_bias and qwen2.tie_word_embeddings and not qwen2.qk_norm
    qwen3 = ModelArgs.from_dict(config_dict("qwen3"))
    assert qwen3.qk_norm and qwen3.head_dim == 24 and qwen3.head_dim * qwen3.num_attention_heads != 64
    llama = ModelArgs.from_dict(config_dict("llama", attention_bias=True))
    assert llama.qkv_bias and llama.o_bias


def test_unsupported_architecture_is_named() -> None:
    with pytest.raises(UnsupportedModelError, match="GPT2LMHeadModel"):
        ModelArgs.from_dict({"model_type": "gpt2", "architectures": ["GPT2LMHeadModel"]})


def test_unsupported_rope_scaling_is_named() -> None:
    config = config_dict("qwen2", rope_scaling={"rope_type": "dynamic", "factor": 4.0})
    with pytest.raises(UnsupportedModelError, match="dynamic"):
        ModelArgs.from_dict(config)


@pytest.mark.parametrize("yarn", [
    {"factor": 4.0, "original_max_position_embeddings": 32768},  # Qwen2.5's long-context setting
    {"factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0, "truncate": False, "original_max_position_embeddings": 4096},
    {"factor": 40.0, "mscale": 1.0, "mscale_all_dim": 1.0, "beta_fast": 32, "beta_slow": 1,
     "original_max_position_embeddings": 4096},  # DeepSeek V3's
    {"factor": 16.0, "mscale": 0.707, "mscale_all_dim": 1.0, "original_max_position_embeddings": 4096},
    {"factor": 8.0, "attention_factor": 0.9, "original_max_position_embeddings": 2048},
])
def test_yarn_frequencies_and_attention_factor_match_transformers(yarn: dict) -> None:
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    from exo_like.models.config import rope_attention_factor

    config = hf_config("qwen2", 2, 300, TOKEN_IDS, rope_scaling={"rope_type": "yarn", **yarn})
    expected, factor = ROPE_INIT_FUNCTIONS["yarn"](config, "cpu")
    args = ModelArgs.from_dict(config.to_dict())
    np.testing.assert_allclose(rope_inv_freq(args), expected.numpy(), rtol=1e-6)
    assert rope_attention_factor(args) == pytest.approx(factor, rel=1e-12)


def test_gguf_rope_freq_factors_divide_the_frequencies_and_are_checked() -> None:
    """llama.cpp's rope_freqs (a GGUF file's config carries them): each frequency divided by its factor, after any
    linear scaling, as llama.cpp rotates by theta / freq_factor."""
    config = config_dict("qwen2", rope_scaling={"rope_type": "linear", "factor": 2.0})  # head_dim 16
    factors = [1.0, 1.5, 2.0, 3.0, 4.0, 6.0, 8.0, 8.0]
    plain = rope_inv_freq(ModelArgs.from_dict(config))
    scaled = ModelArgs.from_dict({**config, "rope_freq_factors": factors})
    assert scaled.rope_freq_factors == tuple(factors)
    np.testing.assert_allclose(rope_inv_freq(scaled), plain / np.array(factors), rtol=1e-7)
    for wrong in (factors[:-1], factors[:-1] + [0.0], factors[:-1] + [float("nan")]):
        with pytest.raises(UnsupportedModelError, match=r"rope_freqs\) must be 8 positive numbers"):
            ModelArgs.from_dict({**config, "rope_freq_factors": wrong})


def test_eos_ids_merge_config_and_generation_config(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text(json.dumps(config_dict("llama")))
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, 7]}))
    assert ModelArgs.from_dir(tmp_path).eos_token_ids == (2, 7)


def test_sliding_windows_are_per_layer_as_transformers_runs_them() -> None:
    """Windows are real (the context is not capped at them): every layer of Mistral 7B v0.1; Qwen2's from
    max_window_layers on, only with use_sliding_window."""
    mistral = ModelArgs.from_dict(config_dict("mistral", sliding_window=4096, max_position_embeddings=32768))
    assert mistral.layer_windows == (4096, 4096) and mistral.context_length == 32768
    no_window = ModelArgs.from_dict(config_dict("mistral", sliding_window=None, max_position_embeddings=32768))
    assert no_window.layer_windows is None and no_window.context_length == 32768
    qwen2 = ModelArgs.from_dict(config_dict("qwen2", sliding_window=1024, use_sliding_window=False))
    assert qwen2.layer_windows is None and qwen2.context_length == 4096
    config = {**config_dict("qwen2", sliding_window=1024, use_sliding_window=True, max_window_layers=1)}
    config.pop("layer_types", None)  # a Hub config, before transformers 5 wrote the layers' types
    assert ModelArgs.from_dict(config).layer_windows == (None, 1024)
