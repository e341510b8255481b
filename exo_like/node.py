"""The node: owns the model, the engine and the generation loop that the HTTP API serves.

Single-node for now: the whole model runs here through a LocalGenerator. The cluster replaces the generator
with a ring of stages across peers and adds discovery and persistent identity; the API only talks to `Node`.
"""

from __future__ import annotations

import logging
import os
import secrets
import time
from dataclasses import dataclass, field
from pathlib import Path

from exo_like.demo import DEMO_NAME, ensure_demo_model
from exo_like.engines.base import Engine, create_engine
from exo_like.errors import ModelNotFoundError, UnsupportedModelError
from exo_like.generation import LocalGenerator, TokenGenerator
from exo_like.model_config import ModelArgs
from exo_like.shard import Shard
from exo_like.tokenizer import ModelTokenizer

log = logging.getLogger(__name__)


def default_home() -> Path:
    return Path(os.environ.get("EXO_LIKE_HOME") or Path.home() / ".cache" / "exo-like")


@dataclass(frozen=True)
class LoadedModel:
    """A model this node serves: its id, the names requests may use for it, and what describes it."""

    model_id: str
    path: Path
    args: ModelArgs
    tokenizer: ModelTokenizer
    aliases: frozenset[str]
    created: int = field(default_factory=lambda: int(time.time()))

    def answers_to(self, name: str) -> bool:
        return name == self.model_id or name in self.aliases

    def to_json(self) -> dict[str, object]:
        return {"id": self.model_id, "object": "model", "created": self.created, "owned_by": "exo-like",
                "context_length": self.args.context_length}


def resolve_model_dir(spec: str, home: Path) -> tuple[str, Path]:
    """(model id, folder) for `demo`, a local Hugging Face folder, or a folder under <home>/models."""
    if spec == DEMO_NAME:
        return DEMO_NAME, ensure_demo_model(home)
    for candidate in (Path(spec).expanduser(), home / "models" / spec):
        if (candidate / "config.json").is_file():
            folder = candidate.resolve()
            return folder.name, folder
    raise ModelNotFoundError(f"model {spec!r} not found: give 'demo' or a local Hugging Face model folder "
                             f"(with config.json)")


class Node:
    def __init__(self, home: Path, engine_name: str = "auto", device: str | None = None,
                 dtype: str | None = None, node_id: str | None = None):
        self.home = home
        self.node_id = node_id or secrets.token_hex(4)
        self.engine_name = engine_name
        self.device = device
        self.dtype = dtype
        self.model: LoadedModel | None = None
        self.engine: Engine | None = None
        self.generator: TokenGenerator | None = None
        self.started = time.time()
        self.stopping = False  # set when shutdown begins: requests cancelled from then on are not the client's doing

    def load_model(self, spec: str) -> LoadedModel:
        """Load the whole model on this node (blocking: call before serving or from a thread)."""
        model_id, folder = resolve_model_dir(spec, self.home)
        args = ModelArgs.from_dir(folder)
        if args.quantization:
            raise UnsupportedModelError(f"{model_id} is quantized; only float checkpoints are supported",
                                        code="unsupported_quantization")
        tokenizer = ModelTokenizer.from_dir(folder)
        engine = create_engine(self.engine_name, self.device, self.dtype)
        started = time.monotonic()
        engine.load(folder, args, Shard.whole(model_id, args.num_hidden_layers))
        log.info("loaded %s from %s: %d layers on %s %s (%s engine, %.1f MB) in %.1fs", model_id, folder,
                 args.num_hidden_layers, engine.device_name, engine.dtype_name, engine.name,
                 engine.parameter_bytes() / 1e6, time.monotonic() - started)
        self.model = LoadedModel(model_id, folder, args, tokenizer, frozenset({spec, str(folder)}))
        self.engine = engine
        self.generator = LocalGenerator(engine)
        return self.model

    def require_model(self, name: str) -> tuple[LoadedModel, TokenGenerator]:
        """The served model a request names, with the generator that runs it; 404 for any other name."""
        if self.model is None or self.generator is None:
            raise ModelNotFoundError(f"the model {name!r} does not exist: this node serves no model "
                                     f"(start it with --model)")
        if not self.model.answers_to(name):
            raise ModelNotFoundError(f"the model {name!r} does not exist; this node serves {self.model.model_id!r}")
        return self.model, self.generator

    def generation_stats(self) -> dict[str, object]:
        if self.generator is None:
            return {"in_flight_requests": 0, "active_kv_caches": 0, "requests_total": 0, "tokens_generated_total": 0}
        return self.generator.stats()

    def status(self) -> dict[str, object]:
        """What /health reports (and what a dashboard shows about this node)."""
        return {
            "status": "stopping" if self.stopping else "ok",
            "node_id": self.node_id,
            "model": self.model.model_id if self.model else None,
            "engine": self.engine.name if self.engine else None,
            "device": self.engine.device_name if self.engine else None,
            "dtype": self.engine.dtype_name if self.engine else None,
            "uptime_seconds": round(time.time() - self.started, 1),
            **self.generation_stats(),
        }

    def in_flight(self) -> list[dict[str, object]]:
        if self.generator is None:
            return []
        return [progress.to_json() for progress in self.generator.in_flight.values()]

    async def close(self) -> None:
        if self.generator is not None:
            await self.generator.close()
        log.info("node stopped")
