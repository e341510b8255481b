"""The models a node's API names: resolved by the registry, served by the cluster's instances (asked for on demand,
loaded, pinned, unloaded), pulled into and deleted from this node's cache, and listed with their states."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from pathlib import Path

from exo_like.errors import ExoLikeError, InvalidRequestError, ModelNotFoundError, ServiceUnavailableError
from exo_like.instances.manager import Instances
from exo_like.models.hub.download import ShardDownloader
from exo_like.models.hub.repo import delete_revision
from exo_like.models.names.model_registry import ModelRegistry
from exo_like.models.names.resolver import LoadedModel
from exo_like.models.shard import Shard
from exo_like.serving.generation import TokenGenerator

log = logging.getLogger(__name__)


class ModelLifecycle:
    """`instances`: the cluster's instances once the node has joined (None before); `stopping`: whether the node is
    shutting down (new requests are refused)."""

    def __init__(self, node_id: str, models: ModelRegistry, downloader: ShardDownloader, cache_dir: Path,
                 instances: Callable[[], Instances | None], stopping: Callable[[], bool], created: int):
        self.node_id = node_id
        self.models = models
        self.downloader = downloader
        self.cache_dir = cache_dir
        self._instances = instances
        self._stopping = stopping
        self._created = created  # the listing's `created`: when the node started

    @property
    def instances(self) -> Instances | None:
        return self._instances()

    def served(self) -> list[LoadedModel]:
        """The models the cluster serves (those this node has the description of), oldest first."""
        if self._instances() is None:
            return []
        models = []
        for key in dict.fromkeys(instance.model for instance in self.instances.instances.values()):
            try:
                model = self.models.known(key)
            except ExoLikeError:
                continue  # the model cannot be read here: its instance's problem says why
            if model is not None:
                models.append(model)
        return models

    async def require(self, name: str, keep_alive: float | None = None,
                            streamed: bool = True) -> tuple[LoadedModel, TokenGenerator]:
        """The model a request names, with the generator that runs it: the cluster serves it from now on if it did
        not (placed, fetched and loaded while the request waits: a streamed one as long as the load takes, its
        connection open; a non-streamed one up to a limit, then a 503 with Retry-After)."""
        if self._instances() is None:
            raise ServiceUnavailableError("the node is still starting", code="starting")
        if self._stopping():
            raise ServiceUnavailableError("the node is shutting down; send the request to another node of the "
                                          "cluster", code="shutting_down")
        model = await self.models.prepare(name)
        instance = self.instances.require(model.key, keep_alive)
        if not streamed and not instance.ever_ready:
            await instance.wait_loaded()
        return model, instance.part.generator

    async def load(self, name: str, keep_alive: float | None = None) -> LoadedModel:
        """The model a name refers to, once the cluster has loaded it (asked for now if it was not)."""
        if self._instances() is None:
            raise ServiceUnavailableError("the node is still starting", code="starting")
        model = await self.models.prepare(name)
        await self.instances.require(model.key, keep_alive).wait_ready()
        return model

    async def pin(self, name: str, nodes: tuple[str, ...] = ()) -> tuple[LoadedModel, str]:
        """Serve the model a name refers to (on `nodes`) until it is unloaded by name: the load API. The model and
        its instance's key. A model that cannot fit beside the busy ones is refused (InsufficientMemoryError),
        nothing else disturbed."""
        if self._instances() is None:
            raise ServiceUnavailableError("the node is still starting", code="starting")
        model = await self.models.prepare(name)
        return model, self.instances.pin(model.key, nodes).key

    async def pull(self, model: LoadedModel) -> None:
        """Every weight file of a hub model in this node's cache (Ollama's pull); a model on disk has nothing to
        fetch."""
        if model.manifest is not None:
            whole = Shard.whole(model.key, model.args.num_hidden_layers)
            try:
                await self.downloader.ensure(model.manifest, model.path, whole, model.args.tie_word_embeddings,
                                             f"pull:{model.key}")
            finally:
                self.downloader.forget(f"pull:{model.key}")

    async def delete(self, name: str) -> None:
        """Remove a downloaded model from this node's cache (unloaded first, on every node, if it is served)."""
        model = self.models.known(name)
        if model is None or model.manifest is None:
            if model is not None:
                raise InvalidRequestError(f"{model.model_id} is a folder on this node's disk ({model.path}), not a "
                                          "download: remove it yourself", param="model", code="not_downloaded")
            raise ModelNotFoundError(f"the model {name!r} is not downloaded on this node")
        await self.unload(model.key)
        removed = await asyncio.to_thread(delete_revision, self.cache_dir, model.manifest.repo_id,
                                          model.manifest.commit)
        if not removed:
            raise ModelNotFoundError(f"{model.model_id} has no files in this node's cache {self.cache_dir}")
        log.info("node %s: deleted %s@%s from its cache", self.node_id, model.manifest.repo_id, model.manifest.commit)

    async def unload(self, name: str) -> bool:
        """Stop serving an instance (by its key, as GET /v1/instances lists it), or every instance of the model a
        name refers to, on every node; whether any was served."""
        if self._instances() is None:
            return False
        if name in self.instances.instances:
            return self.instances.unload(name)
        model = await self.models.prepare(name)
        return self.instances.unload(model.key)

    def listing(self) -> list[dict[str, object]]:
        """GET /v1/models: the served models first, then local folders, downloaded repos and the catalog."""
        return self.models.listing(self._served_states(), self._created)

    def entry(self, name: str) -> dict[str, object]:
        return self.models.entry(name, self._served_states(), self._created)

    def _served_states(self) -> list[tuple[LoadedModel, str]]:
        """Each served model with its state: serving once its instance is ready, loading until then."""
        assert self.instances is not None or not self.served()
        return [(model, "serving" if any(i.ready for i in self.instances.of(model.key))  # type: ignore[union-attr]
                 else "loading") for model in self.served()]

