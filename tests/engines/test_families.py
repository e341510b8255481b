"""The families beyond Llama/Qwen on both engines against transformers, from random checkpoints with their real
structure (tests/checkpoints.py): the mixtures of experts (Qwen3-MoE, Qwen2-MoE, Mixtral: several experts, top-k > 1,
a dense layer among sparse ones, a gated shared expert), Phi-3 (projections stored fused), Gemma 2/3 (sliding
windows of 8 positions, shorter than the prompts; soft-capping; local and global rope bases) and gpt-oss (sinks,
windows of 8, YaRN, a biased router and clamped biased experts stored stacked) and DeepSeek V2/V3 (latent attention
with ranks of 32, a dense first layer, shared and group-routed experts, YaRN with mscale)."""

from __future__ import annotations

from collections.abc import Callable
from functools import cache
from pathlib import Path

import numpy as np
import pytest
import torch

from exo_like.engines.base import Engine
from exo_like.engines.choice import create_engine
from exo_like.engines.work import BLOCK_SIZE, window_start
from exo_like.models.config import ModelArgs
from exo_like.models.shard import Shard
from tests.checkpoints import (FUSED_ARCHITECTURES, GEMMA_ARCHITECTURES, MLA_ARCHITECTURES, MOE_ARCHITECTURES,
                               SINK_ARCHITECTURES, PHI3_LONGROPE,
                               make_checkpoint, make_mlx_mxfp4_checkpoint, make_mxfp4_checkpoint)
from tests.engine_driver import Driver, generate_together
from tests.native_kernels import NATIVE

from tests.gc_freeze import freeze_what_lives_now  # noqa: E402

# Collections skip what this file keeps (tests/conftest.py)
pytestmark = pytest.mark.usefixtures("objects_kept_by_this_file_frozen")

N_LAYERS = 4
ARCHITECTURES = (*MOE_ARCHITECTURES, *FUSED_ARCHITECTURES, *GEMMA_ARCHITECTURES, *SINK_ARCHITECTURES,
                 *MLA_ARCHITECTURES)
# Llama-family checkpoints with windows of 8: every layer (Mistral 7B v0.1's kind), layers 2 and 3 (Qwen2's rule)
WINDOWED = {"mistral_window": ("mistral", {"sliding_window": 8}),
            "qwen2_window": ("qwen2", {"sliding_window": 8, "use_sliding_window": True, "max_window_layers": 2})}
LONGROPE = {"phi3_longrope": PHI3_LONGROPE}
N_TOKENS = 48
CHAINS = {"torch": ("torch",), "mlx": ("mlx",), "torch+mlx+torch": ("torch", "mlx", "torch"),
          "mlx+torch+mlx": ("mlx", "torch", "mlx")}


@pytest.fixture(scope="module")
def family_dirs(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("families")
    # seeds giving each a varied greedy continuation of prompt "a"
    made = {arch: make_checkpoint(root / arch, arch, n_layers=N_LAYERS, seed=2 if arch == "gemma3_text" else 3)
            for arch in ARCHITECTURES}
    made.update({name: make_checkpoint(root / name, arch, n_layers=N_LAYERS, seed=3, **overrides)
                 for name, (arch, overrides) in {**WINDOWED, **LONGROPE}.items()})
    return made


@pytest.fixture(scope="module")
def prompts() -> dict[str, np.ndarray]:
    rng = np.random.default_rng(7)
    return {rid: rng.integers(3, 600, size=length) for rid, length in zip("abcdefgh", (40, 9, 23, 3, 31, 17, 5, 12))}


@cache
def transformers_model(path: Path) -> torch.nn.Module:
    """transformers' float32 model of a checkpoint, loaded once for every oracle call on it."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    freeze_what_lives_now()  # the model and the modeling code its first load imported
    return model


@cache
def transformers_greedy(path: Path, prompt: tuple[int, ...], n: int) -> list[int]:
    ids = torch.tensor(prompt)[None]
    with torch.no_grad():
        out = transformers_model(path).generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                                                max_new_tokens=n, min_new_tokens=n, eos_token_id=None, pad_token_id=0)
    return out[0, ids.shape[1]:].tolist()


def load_chain(path: Path, engines: tuple[str, ...]) -> list[Engine]:
    args = ModelArgs.from_dir(path)
    bounds = [round(i * N_LAYERS / len(engines)) for i in range(len(engines) + 1)]
    chain = []
    for name, start, end in zip(engines, bounds, bounds[1:]):
        engine = create_engine(name, device="cpu", dtype="float32")
        engine.load(path, args, Shard(path.name, start, end, N_LAYERS))
        chain.append(engine)
    return chain


def greedy(driver: Driver, prompt: np.ndarray, n: int, rid: str = "r") -> list[int]:
    return greedy_logits(driver, prompt, n, rid)[0]


def greedy_logits(driver: Driver, prompt: np.ndarray, n: int, rid: str = "r") -> tuple[list[int], np.ndarray]:
    tokens, inputs, logits = [], prompt, []
    for _ in range(n):
        logits.append(driver.forward(rid, inputs))
        tokens.append(int(np.argmax(logits[-1])))
        inputs = np.array([tokens[-1]])
    return tokens, np.stack(logits)


@cache
def transformers_logits(path: Path, tokens: tuple[int, ...]) -> np.ndarray:
    """transformers' logits at every position of `tokens` (computed once per sequence: every chain of a correct
    engine decodes the same tokens, so asks for the same sequence)."""
    with torch.no_grad():
        logits = transformers_model(path)(torch.tensor([tokens])).logits[0].numpy()
    logits.flags.writeable = False
    return logits


@pytest.fixture(scope="module")
def chains() -> Callable[[Path, str], list[Engine]]:
    """(checkpoint, chain name) -> the chain's engines, loaded once and shared by the module's tests: each test
    drives them through a Driver of its own (fresh block tables over the engines' pools), as the ring serves one
    request after another on the engines it loaded once."""
    loaded: dict[tuple[Path, str], list[Engine]] = {}

    def get(path: Path, chain: str) -> list[Engine]:
        if (path, chain) not in loaded:
            freeze_what_lives_now()
            loaded[path, chain] = load_chain(path, CHAINS[chain])
        return loaded[path, chain]

    return get


@pytest.mark.parametrize("chain", CHAINS)
@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_greedy_tokens_equal_transformers(family_dirs, chains, prompts, arch, chain):
    """48 greedy tokens after a 40-token prompt, on one engine and split over three (layer 1 of Qwen3-MoE, dense,
    sits on the middle stage), equal transformers' float32 tokens."""
    path = family_dirs[arch]
    expected = transformers_greedy(path, tuple(prompts["a"].tolist()), N_TOKENS)
    assert greedy(Driver(chains(path, chain)), prompts["a"], N_TOKENS) == expected
    assert len(set(expected)) > 10  # a varied continuation, not a loop on one token


@pytest.mark.parametrize("chain", ["torch", "mlx"])
@pytest.mark.parametrize("arch", ["qwen3_moe", "gemma3_text", "gpt_oss", "deepseek_v3"])
def test_eight_requests_in_one_batch_equal_each_alone(family_dirs, chains, prompts, arch, chain):
    """Eight requests joining one after another, every active one in each step (prompt chunks of 7 beside decode
    tokens, several decode rows attended together): each request's tokens and logits are its own, as alone.
    Qwen3-MoE: rows of different requests pick different experts in one step, so every expert's rows are gathered
    from across the batch. Gemma 3: each row attends through its own window (8) of its own request."""
    engines = chains(family_dirs[arch], chain)
    n = 10
    together = generate_together(Driver(engines), prompts, n, chunk=7, joins={rid: i for i, rid in enumerate(prompts)})
    assert together.widest == 8 and together.mixed_steps >= 5
    driver = Driver(engines)
    for rid, prompt in prompts.items():
        tokens, logits = greedy_logits(driver, prompt, n, rid)
        assert together.tokens[rid] == tokens, rid
        np.testing.assert_allclose(together.stacked(rid), logits, rtol=1e-5, atol=1e-4, err_msg=rid)


@pytest.mark.parametrize("chain", CHAINS)
@pytest.mark.parametrize("arch", [*GEMMA_ARCHITECTURES, *SINK_ARCHITECTURES, *WINDOWED, *MLA_ARCHITECTURES,
                                  *LONGROPE])
def test_chunked_prompt_and_decode_give_transformers_logits(family_dirs, chains, prompts, arch, chain):
    """A 40-token prompt in chunks of 7 (chunks starting past the window of 8), then 12 decode steps: every
    sampled row's logits equal transformers' forward over the whole sequence. (Greedy tokens alone would not
    show a missing window: this checkpoint's soft-capped logits keep the same top token either way.) MLA: the
    absorbed form reassociates transformers' products, so equal to rounding."""
    path = family_dirs[arch]
    driver = Driver(chains(path, chain))
    prompt = prompts["a"]
    ours, positions = [], []
    for start in range(0, len(prompt), 7):
        chunk = prompt[start:start + 7]
        ours.append(driver.forward("r", chunk))
        positions.append(start + len(chunk) - 1)
    tokens, decoded = greedy_logits(driver, np.array([int(np.argmax(ours[-1]))]), 12)
    sequence = [*prompt.tolist(), int(np.argmax(ours[-1])), *tokens[:-1]]
    expected = transformers_logits(path, tuple(sequence))
    positions += list(range(len(prompt), len(prompt) + 12))
    np.testing.assert_allclose(np.concatenate([np.stack(ours), decoded]), expected[positions], rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("engine_name", ["torch", "mlx"])
def test_latent_attention_caches_one_latent_a_position(family_dirs, chains, engine_name):
    """DeepSeek's cache: per layer and position the normalised latent (rank 32) and the shared rotated key (8),
    40 values, no value pool; full keys and values would be 4 heads x (24 + 16) = 160."""
    from exo_like.engines.work import BLOCK_SIZE

    engine = chains(family_dirs["deepseek_v3"], engine_name)[0]
    engine.allocate_kv(4)  # (a later Driver on this engine allocates its own pool again)
    assert engine.kv_block_bytes() == (N_LAYERS * BLOCK_SIZE * 40 * 4, 0)  # (no sliding-window layers)
    assert ModelArgs.from_dir(family_dirs["deepseek_v3"]).kv_layout() == (1, 40, 0)


def test_sparse_and_dense_layers_follow_the_config(family_dirs, chains):
    """Qwen3-MoE's `mlp_only_layers` makes layer 1 dense; every other layer is a mixture."""
    args = ModelArgs.from_dir(family_dirs["qwen3_moe"])
    assert [args.is_sparse_layer(i) for i in range(N_LAYERS)] == [True, False, True, True]
    assert (args.moe.n_experts, args.moe.top_k, args.moe.renormalize) == (8, 3, True)
    engine = chains(family_dirs["qwen3_moe"], "torch")[0]
    kinds = [type(layer.mlp).__name__ for layer in engine.model.layers]
    assert kinds == ["SparseMoe", "MLP", "SparseMoe", "SparseMoe"]


def test_mixtral_experts_are_read_under_the_shared_names(family_dirs, chains):
    """Mixtral's `block_sparse_moe.experts.E.w1/w2/w3` load as the experts' gate, down and up projections: the
    torch engine holds each expert's gate rows then up rows in one matrix."""
    from safetensors import safe_open

    path = family_dirs["mixtral"]
    engine = chains(path, "torch")[0]
    with safe_open(str(path / "model.safetensors"), "pt") as f:
        w1, w3 = (f.get_tensor(f"model.layers.2.block_sparse_moe.experts.4.{w}.weight") for w in ("w1", "w3"))
        w2 = f.get_tensor("model.layers.2.block_sparse_moe.experts.4.w2.weight")
    expert = engine.model.layers[2].mlp.experts[4]
    torch.testing.assert_close(expert.gate_up_proj.dense_weight(), torch.cat([w1, w3]), rtol=0, atol=0)
    torch.testing.assert_close(expert.down_proj.dense_weight(), w2, rtol=0, atol=0)


@pytest.mark.parametrize("change, named", [
    ({"model_type": "glm4_moe", "architectures": ["Glm4MoeForCausalLM"]}, "Glm4MoeForCausalLM"),
    ({"rope_scaling": {"type": "longrope", "short_factor": [1.0] * 7, "long_factor": [2.0] * 7,
                       "original_max_position_embeddings": 4096}}, "long_factor has 7 values"),
    ({"rope_scaling": {"type": "dynamic", "factor": 2.0}}, "dynamic"),
    ({"partial_rotary_factor": 1.5}, "partial_rotary_factor 1.5"),
])
def test_what_is_not_supported_is_refused_naming_it(family_dirs, change, named):
    import json

    from exo_like.errors import UnsupportedModelError

    config = {**json.loads((family_dirs["phi3"] / "config.json").read_text()), **change}
    with pytest.raises(UnsupportedModelError, match=named):
        ModelArgs.from_dict(config)


@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_parameter_counts_equal_transformers(family_dirs, arch):
    """Total parameters as transformers holds them (a tied head once); active ones: all but the routed experts
    a token does not run through (n_experts - top_k of them in each sparse layer)."""
    from exo_like.models.parameters import count_parameters

    path = family_dirs[arch]
    model = transformers_model(path)
    args = ModelArgs.from_dir(path)
    total = sum(p.numel() for p in model.parameters())
    skipped = 0
    for i, layer in enumerate(model.model.layers):
        moe = getattr(layer, "block_sparse_moe", None) or layer.mlp  # Mixtral's name, or everyone else's
        experts = getattr(moe, "experts", None)
        if experts is not None:
            per_expert = sum(p.numel() for p in experts.parameters()) // args.moe.n_experts
            skipped += (args.moe.n_experts - args.moe.top_k) * per_expert
    assert count_parameters(args).to_json() == {"total": total, "active": total - skipped}


@pytest.fixture(scope="module")
def mxfp4_dirs(family_dirs, tmp_path_factory) -> dict[str, Path]:
    """gpt-oss with MXFP4 experts: as the Hub's openai/gpt-oss checkpoints store them, and as mlx-community's."""
    root = tmp_path_factory.mktemp("mxfp4")
    hub = make_mxfp4_checkpoint(family_dirs["gpt_oss"], root / "hub")
    return {"hub": hub, "mlx": make_mlx_mxfp4_checkpoint(hub, root / "mlx")}


@pytest.mark.parametrize("chain", ["torch", "mlx", "torch+mlx+torch"])
@pytest.mark.parametrize("form", ["hub", "mlx"])
def test_mxfp4_experts_give_transformers_tokens(mxfp4_dirs, chains, prompts, form, chain):
    """transformers dequantizes the Hub's MXFP4 experts on CPU; float32 here too: torch reads each expert as exact
    5-bit groups and dequantizes them (--dtype float32), MLX runs its mxfp4 kernel with float32 activations."""
    expected = transformers_greedy(mxfp4_dirs["hub"], tuple(prompts["a"].tolist()), N_TOKENS)
    assert greedy(Driver(chains(mxfp4_dirs[form], chain)), prompts["a"], N_TOKENS) == expected
    assert len(set(expected)) > 10


@pytest.mark.parametrize("form", ["hub", "mlx"])
def test_mxfp4_experts_stay_quantized_and_are_held_as_the_footprint_says(mxfp4_dirs, form):
    """MLX holds the experts in its mxfp4 form (the checkpoint's bytes); torch as exact 5-bit groups on its int4
    kernel (two packs); the footprint counts what each holds, so placement sizes gpt-oss's shards right."""
    from exo_like.models.footprint import model_footprint

    path = mxfp4_dirs[form]
    args = ModelArgs.from_dir(path)
    assert args.quant.mxfp4
    footprint = model_footprint(path, N_LAYERS, args.tie_word_embeddings, args.quant)
    experts = args.moe.n_experts
    routers = {"mlx": {"mlx 8-bit": 2}, "hub": {}}[form]  # mlx-community keeps gpt-oss's routers at 8 bits
    for engine_name, dtype, forms in (("torch", None, {"mxfp4": 2 * 2 * experts}), ("torch", "float32", {}),
                                      ("mlx", None, {"mlx mxfp4": 2 * 3, **routers})):
        shard = Shard(path.name, 1, 3, N_LAYERS)
        engine = create_engine(engine_name, device="cpu", dtype=dtype)
        engine.load(path, args, shard)
        assert engine.weight_forms.quantized == forms, (engine_name, dtype)
        # 6 router outputs, below the int4 kernel's tiles; float32 scales, which the native kernels do not keep
        if engine_name == "torch" and dtype is None:
            assert sum(engine.weight_forms.dequantized.values()) == sum(routers.values())
        held = footprint.held_by(engine_name, dtype, native=NATIVE).shard_bytes(shard)
        assert held == engine.parameter_bytes(), (engine_name, dtype)


@pytest.mark.parametrize("arch", [*SINK_ARCHITECTURES, *MLA_ARCHITECTURES])
def test_the_speed_probe_times_a_layer_of_the_models_shapes(family_dirs, arch):
    """Placement by speed times one random layer of the model's shapes (engines/torch/layer.py): those shapes hold
    exactly the parameters a loaded shard's layer does, and the probe runs on both engines."""
    import math

    from exo_like.models.parameters import layer_shapes

    path = family_dirs[arch]
    args = ModelArgs.from_dir(path)
    layer = args.moe.sparse_layers[0]
    engine = create_engine("torch", device="cpu", dtype="float32")
    engine.load(path, args, Shard(path.name, layer, layer + 1, N_LAYERS))
    held = sum(p.numel() for p in engine.model.layers[0].parameters())
    assert sum(math.prod(shape) for shape in layer_shapes(args, layer).values()) == held
    for engine_name in ("torch", "mlx"):
        runner = create_engine(engine_name, device="cpu", dtype="float32").layer_runner(path, args)
        runner.decode()
        runner.prefill()


@pytest.mark.parametrize("chain", ["torch", "mlx"])
@pytest.mark.parametrize("arch", ["gpt_oss", "deepseek_v3"])
def test_a_request_reusing_another_requests_prefix_blocks_gives_its_own_logits(family_dirs, chains, prompts, arch,
                                                                              chain):
    """The prefix cache's situation: request b's block table starts with request a's first two blocks (32
    positions of the same prompt), and b computes only the rest. Sliding windows and sinks (gpt-oss) and the latent
    cache (DeepSeek) read those shared blocks as b's own: its logits equal b's alone."""
    engines = chains(family_dirs[arch], chain)
    shared, rest = prompts["a"][:32], prompts["e"][:9]
    driver = Driver(engines)
    driver.forward("a", prompts["a"])
    driver.tables["b"], driver.lengths["b"] = list(driver.tables["a"][:2]), 32
    if driver.window is not None:  # and the sliding-window layers' blocks b's window reaches from position 32
        first, table = driver.window_tables["a"]
        reach = window_start(32, driver.window) // BLOCK_SIZE
        driver.window_tables["b"] = reach, table[reach - first:2 - first]
    reused = greedy_logits(driver, rest, 8, "b")
    alone = greedy_logits(Driver(engines), np.concatenate([shared, rest]), 8, "b")
    assert reused[0] == alone[0]
    np.testing.assert_allclose(reused[1], alone[1], rtol=1e-5, atol=1e-4)
