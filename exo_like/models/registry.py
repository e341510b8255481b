"""The models a node knows: what a name refers to (read once), and what planning needs about it.

Local folders and `demo` are read from disk. A hub model's description (config, tokenizer, per-layer bytes) may
have to come from the hub, so it is fetched in a worker thread and the event loop is never blocked: until it
arrives, describe() raises ModelPendingError (the cluster waits), and a failure is kept for a while so that
re-plans do not hammer the hub.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Callable

from exo_like.errors import ExoLikeError, ModelNotFoundError, ModelPendingError
from exo_like.models.catalog import PACKAGED, entry_for_repo
from exo_like.models.config import ModelArgs
from exo_like.models.demo import DEMO_NAME, ensure_demo_model
from exo_like.models.footprint import ModelDescription, ModelFootprint, model_footprint
from exo_like.models.gguf.file import is_gguf, open_gguf
from exo_like.models.gguf.hub import gguf_description
from exo_like.models.gguf.select import split_tag, with_tag
from exo_like.models.gguf.tokenizer import gguf_tokenizer
from exo_like.models.hub.repo import RepoManifest
from exo_like.models.source import HubModel, list_models, locate, prepare_hub_model, split_revision
from exo_like.models.tokenizer import ModelTokenizer

log = logging.getLogger(__name__)

RETRY_DESCRIBE_SECONDS = 30.0  # a model whose description could not be fetched is tried again after this long


@dataclass(frozen=True)
class LoadedModel:
    """A model this node can serve: its id, the names requests may use for it, and what describes it."""

    model_id: str
    key: str  # how peers name it: "demo", the folder's absolute path, or repo id@commit[:TAG] (HubModel.key)
    path: Path  # for a hub model: its snapshot folder in the cache, where the shard's weight files arrive (a GGUF
    # repo: the sparse first part of the file, where the shard's byte ranges arrive)
    args: ModelArgs
    tokenizer: ModelTokenizer
    aliases: frozenset[str]
    manifest: RepoManifest | None = None  # hub models: the weight files and the bytes per layer
    footprint: ModelFootprint | None = None  # local models: the bytes per layer
    created: int = field(default_factory=lambda: int(time.time()))

    def answers_to(self, name: str) -> bool:
        return name == self.model_id or name in self.aliases

    def to_json(self) -> dict[str, object]:
        return {"id": self.model_id, "object": "model", "created": self.created, "owned_by": "exo-like",
                "context_length": self.args.context_length}

    def listing(self) -> dict[str, object]:
        """Its entry in GET /v1/models."""
        where = ({"source": "hub", "repo": self.manifest.repo_id, "revision": self.manifest.commit}
                 if self.manifest is not None else {"source": "local", "path": str(self.path.resolve())})
        return {**self.to_json(), **where}


def resolve_model_dir(spec: str, home: Path) -> tuple[str, Path]:
    """(model id, folder or GGUF file) for `demo`, a local Hugging Face folder, a GGUF file (or a folder holding
    one), either under <home>/models too, or a model shipped in a Python package."""
    if spec == DEMO_NAME:
        return DEMO_NAME, ensure_demo_model(home)
    source = locate(spec, home)
    if source.kind != "local" or source.folder is None:
        raise ModelNotFoundError(f"model {spec!r} not found: give 'demo', a local Hugging Face model folder "
                                 f"(with config.json) or a GGUF file")
    if is_gguf(source.folder):
        packaged = PACKAGED.get(spec.strip().lower())
        return (packaged.name if packaged else source.folder.stem), source.folder
    return source.folder.name, source.folder


def read_local_model(folder: Path) -> tuple[ModelArgs, ModelTokenizer, ModelFootprint]:
    """Config, tokenizer and per-layer bytes of a local Hugging Face folder or GGUF file (headers only)."""
    if is_gguf(folder):
        args, footprint = gguf_description(folder)
        return args, gguf_tokenizer(open_gguf(folder).metadata, folder.name), footprint
    args = ModelArgs.from_dir(folder)
    footprint = model_footprint(folder, args.num_hidden_layers, args.tie_word_embeddings, args.quant)
    return args, ModelTokenizer.from_dir(folder), footprint


class ModelRegistry:
    def __init__(self, home: Path, cache_dir: Path, node_id: str, on_prepared: Callable[[str], None]):
        self.home = home
        self.cache_dir = cache_dir
        self.node_id = node_id
        self._on_prepared = on_prepared  # called on the event loop when a hub description arrives (or fails)
        self._models: dict[str, LoadedModel] = {}
        self._descriptions: dict[str, ModelDescription] = {}  # by model key: re-plans must not re-read headers
        self._preparing: dict[str, asyncio.Future[LoadedModel]] = {}  # hub descriptions being fetched
        self._failures: dict[str, tuple[float, ExoLikeError]] = {}  # the last failure of each, with when

    def resolve(self, spec: str) -> LoadedModel:
        """The model a name refers to (demo, a folder, a catalog name, a hub repo, or one already known).

        Blocking: a hub model's description may be fetched from the hub, so call this before the event loop
        runs or from a worker thread (prepare() does)."""
        known = self._lookup(spec)
        if known is not None:
            return known
        source = locate(spec, self.home)
        if source.kind == "hub":
            return self._remember(self._hub_model(prepare_hub_model(source, self.cache_dir), spec))
        model_id, folder = resolve_model_dir(spec, self.home)
        args, tokenizer, footprint = read_local_model(folder)
        key = DEMO_NAME if spec == DEMO_NAME else str(folder)
        return self._remember(LoadedModel(model_id, key, folder, args, tokenizer,
                                          frozenset({spec, model_id, str(folder), key}), footprint=footprint))

    def files(self, key: str) -> tuple[Path, ModelArgs]:
        """A described model's folder and config (what measuring a layer of it needs; no network then)."""
        model = self.resolve(key)
        return model.path, model.args

    def known(self, spec: str) -> LoadedModel | None:
        """The model if it can be had without the network: known already, or demo / a local folder (disk only)."""
        known = self._lookup(spec)
        if known is None and locate(spec, self.home).kind != "hub":
            known = self.resolve(spec)
        return known

    async def prepare(self, spec: str) -> LoadedModel:
        """resolve() without blocking the event loop; concurrent callers share one fetch."""
        known = self.known(spec)
        if known is not None:
            return known
        return await asyncio.shield(self._preparation(spec))

    async def by_name(self, name: str, served: LoadedModel) -> LoadedModel:
        """`served` if a request's model `name` refers to it, else ModelNotFoundError. Besides the served model's
        own names, `org/name@revision` of its repo counts when the revision is the served commit: another node
        may have been started with that name. Such a revision is resolved once, then kept as a name."""
        if served.answers_to(name) or served.answers_to(with_tag(*split_tag(name))):  # any spelling of a GGUF tag
            return served
        repo_id, revision = split_revision(name)
        if revision is not None and served.manifest is not None and served.answers_to(repo_id):
            named = await self.prepare(name)
            if named.key == served.key:
                return named
            raise ModelNotFoundError(f"the model {name!r} is {named.key} at the hub; this cluster serves "
                                     f"{served.key!r}")
        raise ModelNotFoundError(f"the model {name!r} does not exist; this cluster serves {served.key!r}")

    def describe(self, key: str) -> ModelDescription:
        """What planning needs. A hub model not described yet is fetched in the background meanwhile."""
        if key not in self._descriptions:
            model = self.known(key)
            if model is None:
                raise self._pending(key)
            footprint = model.manifest.footprint if model.manifest is not None else model.footprint
            assert footprint is not None  # a local model's is read with it
            self._descriptions[key] = ModelDescription(model.args.num_hidden_layers, footprint)
        return self._descriptions[key]

    def listing(self, served: LoadedModel | None, created: int) -> list[dict[str, Any]]:
        """GET /v1/models: the served model first, then local folders, downloaded repos and the catalog."""
        return list_models(self.home, self.cache_dir, served.listing() if served else None, created)

    def entry(self, name: str, served: LoadedModel | None, created: int) -> dict[str, Any]:
        """GET /v1/models/{name}: the listed model the name refers to (the served model by any of its names)."""
        entries = self.listing(served, created)
        for entry in entries:
            if name in (entry["id"], entry.get("repo"), entry.get("path")):
                return entry
        if served is not None and served.answers_to(name):
            return entries[0]
        raise ModelNotFoundError(f"the model {name!r} does not exist: GET /v1/models lists the models")

    # -- internals ------------------------------------------------------------------------------------------

    def _hub_model(self, hub: HubModel, spec: str) -> LoadedModel:
        entry = entry_for_repo(hub.repo_id)
        aliases = {spec, hub.repo_id, hub.name, hub.key} | ({entry.name} if entry else set())
        tokenizer = (gguf_tokenizer(open_gguf(hub.folder).metadata, hub.folder.name) if is_gguf(hub.folder)
                     else ModelTokenizer.from_dir(hub.folder))
        return LoadedModel(hub.name, hub.key, hub.folder, hub.args, tokenizer, frozenset(aliases), hub.manifest)

    def _remember(self, model: LoadedModel) -> LoadedModel:
        known = self._models.get(model.key)
        if known is not None:  # the same model by another name (a revision that resolved to the same commit)
            model = replace(known, aliases=known.aliases | model.aliases)
        self._models[model.key] = model
        return model

    def _lookup(self, spec: str) -> LoadedModel | None:
        for model in list(self._models.values()):  # a copy: worker threads may add models meanwhile
            if model.answers_to(spec) or model.key == spec:
                return model
        return None

    def _preparation(self, spec: str) -> asyncio.Future[LoadedModel]:
        future = self._preparing.get(spec)
        if future is None:
            future = asyncio.ensure_future(asyncio.to_thread(self.resolve, spec))
            self._preparing[spec] = future
            future.add_done_callback(lambda done: self._prepared(spec, done))
        return future

    def _prepared(self, spec: str, future: asyncio.Future[LoadedModel]) -> None:
        self._preparing.pop(spec, None)
        if future.cancelled():
            return
        error = future.exception()
        if error is None:
            self._failures.pop(spec, None)
        else:
            failure = error if isinstance(error, ExoLikeError) else ExoLikeError(f"{type(error).__name__}: {error}")
            self._failures[spec] = (time.monotonic(), failure)
            log.error("node %s: cannot use model %s: %s", self.node_id, spec, failure.message)
        self._on_prepared(spec)

    def _pending(self, key: str) -> ExoLikeError:
        failure = self._failures.get(key)
        if failure is not None and time.monotonic() - failure[0] < RETRY_DESCRIBE_SECONDS:
            return failure[1]
        self._preparation(key)
        return ModelPendingError(f"node {self.node_id} is fetching the description of {key} (config, tokenizer "
                                 f"and layer sizes) from the hub")
