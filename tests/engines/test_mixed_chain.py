"""A ring may mix frameworks: MLX and PyTorch shards chained in one process give the same greedy tokens as
Hugging Face transformers' own `generate` on the same checkpoint (float32)."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Callable

import numpy as np
import pytest

pytest.importorskip("mlx.core", reason="mlx is not installed (install the 'mlx' extra)")
torch = pytest.importorskip("torch", reason="torch is not installed (install the 'torch' extra)")
pytest.importorskip("transformers", reason="transformers (the test oracle) is not installed")

from tokenizers import Tokenizer  # noqa: E402

from exo_like.engines.base import Engine  # noqa: E402
from exo_like.engines.choice import create_engine  # noqa: E402
from exo_like.models.config import ModelArgs  # noqa: E402
from exo_like.models.shard import Shard  # noqa: E402
from tests.checkpoints import built_once, make_checkpoint  # noqa: E402
from tests.engine_driver import Driver  # noqa: E402

N_LAYERS = 6
N_TOKENS = 32
SEED = 1  # gives every architecture a non-degenerate greedy continuation of PROMPT
PROMPT = "The quick brown fox jumps over the lazy dog. Paris is the capital of"
UNEVEN_SHARDS = ((0, 1), (1, 4), (4, N_LAYERS))
CHAINS = {"mlx-torch-mlx": ("mlx", "torch", "mlx"), "torch-mlx-torch": ("torch", "mlx", "torch")}
# name -> (architecture, make_checkpoint keyword arguments)
CASES = {
    "llama": ("llama", {}),
    "llama-hub-config": ("llama", {"hub_style_config": True}),
    "mistral": ("mistral", {}),
    "qwen2": ("qwen2", {}),
    "qwen3": ("qwen3", {}),
}


@pytest.fixture(scope="session")
def mixed_model_dir(tmp_path_factory) -> Callable[[str], Path]:
    """name -> checkpoint folder, each written once per session on first use."""
    return built_once(tmp_path_factory.mktemp("mixed_chain_checkpoints"), lambda name, path: make_checkpoint(
        path, CASES[name][0], n_layers=N_LAYERS, seed=SEED, **CASES[name][1]))


@pytest.fixture(scope="session")
def hf_tokens(mixed_model_dir) -> Callable[[str], list[int]]:
    """name -> transformers' greedy continuation of PROMPT (computed once)."""
    done: dict[str, list[int]] = {}

    def get(name: str) -> list[int]:
        if name not in done:
            done[name] = hf_greedy(mixed_model_dir(name))
        return done[name]

    return get


def prompt_ids(model_dir: Path) -> np.ndarray:
    return np.array(Tokenizer.from_file(str(model_dir / "tokenizer.json")).encode(PROMPT).ids, dtype=np.int64)


def hf_greedy(model_dir: Path) -> list[int]:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    config = copy.deepcopy(model.generation_config)
    # No eos: generation must run all N_TOKENS steps so every position is compared.
    config.eos_token_id = None
    config.do_sample = False
    config.max_new_tokens = N_TOKENS
    input_ids = torch.from_numpy(prompt_ids(model_dir))[None]
    with torch.no_grad():
        out = model.generate(input_ids, attention_mask=torch.ones_like(input_ids), generation_config=config)
    new_tokens = out[0, input_ids.shape[1]:].tolist()
    assert len(new_tokens) == N_TOKENS
    return new_tokens


def load_chain(model_dir: Path, engine_names: tuple[str, ...]) -> list[Engine]:
    args = ModelArgs.from_dir(model_dir)
    chain = []
    for name, (start, end) in zip(engine_names, UNEVEN_SHARDS):
        engine = create_engine(name, device="cpu", dtype="float32")
        engine.load(model_dir, args, Shard(model_dir.name, start, end, args.num_hidden_layers))
        chain.append(engine)
    return chain


def chain_greedy(chain: list[Engine], prompt: np.ndarray) -> list[int]:
    """Greedy tokens of one request, one step through every shard of the chain each (the prompt in one)."""
    driver = Driver(chain)
    tokens: list[int] = []
    inputs = prompt
    for _ in range(N_TOKENS):
        token = int(np.argmax(driver.forward("r", inputs)))
        tokens.append(token)
        inputs = np.array([token])
    return tokens


@pytest.mark.parametrize("chain_name", list(CHAINS))
@pytest.mark.parametrize("name", list(CASES))
def test_mixed_chain_matches_transformers_generate(mixed_model_dir, hf_tokens, name, chain_name):
    path = mixed_model_dir(name)
    chain = load_chain(path, CHAINS[chain_name])
    assert [engine.name for engine in chain] == list(CHAINS[chain_name])
    expected = hf_tokens(name)
    assert len(set(expected)) > 1, "degenerate reference continuation; pick another seed or prompt"
    assert chain_greedy(chain, prompt_ids(path)) == expected
