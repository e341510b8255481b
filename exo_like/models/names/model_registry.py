"""The models a node knows: each name resolved once (resolver.py), then found in the cache by any of its names.

Every spelling met is kept: the text as given, its canonical form (name.py) and the model's own names (its id,
key, repo, catalog name); a later lookup by any of them, or by another spelling of one, is answered from the cache
without parsing it twice or asking the hub again.

Local folders and `demo` are read from disk. A hub model's description (config, tokenizer, per-layer bytes) may
have to come from the hub, so it is fetched in a worker thread and the event loop is never blocked: until it
arrives, describe() raises ModelPendingError (the cluster waits), and a failure is kept for a while so that
re-plans do not hammer the hub.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import replace
from pathlib import Path
from collections.abc import Sequence
from typing import Any, Callable

from exo_like.errors import ExoLikeError, ModelNotFoundError, ModelPendingError
from exo_like.models.config import ModelArgs
from exo_like.models.footprint import ModelDescription
from exo_like.models.hub.peer_files import PeerSource, held_commit
from exo_like.models.names.listing import list_models
from exo_like.models.names.name import ModelName, parse_model_name, pinned_key
from exo_like.models.names.resolver import LoadedModel, resolve_model

log = logging.getLogger(__name__)

RETRY_DESCRIBE_SECONDS = 30.0  # a model whose description could not be fetched is tried again after this long


class ModelRegistry:
    def __init__(self, home: Path, cache_dir: Path, node_id: str, on_prepared: Callable[[str], None],
                 peers: Callable[[], Sequence[PeerSource]] = list):
        self.home = home
        self.peers = peers  # the linked peers: a hub model's description (or a name's commit) is asked of them too
        self.cache_dir = cache_dir
        self.node_id = node_id
        self._on_prepared = on_prepared  # called on the event loop when a hub description arrives (or fails)
        self._models: dict[str, LoadedModel] = {}  # by key
        self._keys: dict[str, str] = {}  # every spelling met -> the key of the model it names
        self._hub_names: dict[str, ModelName] = {}  # hub names parsed but not resolved yet: parsed once
        self._preparing: dict[str, asyncio.Future[LoadedModel]] = {}  # hub descriptions being fetched
        self._failures: dict[str, tuple[float, ExoLikeError]] = {}  # the last failure of each, with when

    def resolve(self, text: str) -> LoadedModel:
        """The model a name refers to (demo, a folder, a catalog name, a hub repo, or one already known).

        Blocking: a hub model's description may be fetched from the hub, so call this before the event loop
        runs or from a worker thread (prepare() does)."""
        found = self._find(text)
        if isinstance(found, LoadedModel):
            return found
        return self._remember(resolve_model(found, self.home, self.cache_dir, self.peers()), found)

    def known(self, text: str) -> LoadedModel | None:
        """The model if it can be had without the network: known already, or demo / a local folder (disk only)."""
        found = self._find(text)
        if isinstance(found, LoadedModel):
            return found
        if found.kind == "hub":
            self._hub_names[text] = found  # waiting for its description: describe() asks again at each re-plan
            return None
        return self._remember(resolve_model(found, self.home, self.cache_dir), found)

    def loaded(self, key: str) -> LoadedModel:
        """A described model (a plan's, the speed probe's): from the cache, never from the network."""
        model = self.known(key)
        if model is None:
            raise ModelPendingError(f"node {self.node_id} has no description of {key} yet")
        return model

    async def prepare(self, text: str) -> LoadedModel:
        """resolve() without blocking the event loop; concurrent callers share one fetch."""
        known = self.known(text)
        if known is not None:
            return known
        return await asyncio.shield(self._preparation(text))

    def key_on_disk(self, text: str) -> str | None:
        """For a peer without the hub: the key of the hub model `text` names, if this node has described it or holds
        its description in its cache (else None: this node would have to ask the hub, which the peer could).
        GGUF repos aside: their headers are not shared between peers."""
        found = self._find_quietly(text)
        if isinstance(found, LoadedModel):
            return found.key if found.manifest is not None and not found.manifest.gguf else None
        if found is None or found.kind != "hub" or found.tag is not None:
            return None
        for repo in found.repos:
            commit = held_commit(self.cache_dir, repo, found.revision)
            if commit is not None:
                return pinned_key(repo, commit)
        return None

    def describe(self, key: str) -> ModelDescription:
        """What planning needs. A hub model not described yet is fetched in the background meanwhile."""
        model = self.known(key)
        if model is None:
            raise self._pending(key)
        return model.description

    def files(self, key: str) -> tuple[Path, ModelArgs]:
        """A described model's folder and config (what measuring a layer of it needs; no network then)."""
        model = self.loaded(key)
        return model.path, model.args

    def listing(self, served: list[tuple[LoadedModel, str]], created: int) -> list[dict[str, Any]]:
        """GET /v1/models: the served models first (each with its state), then local folders, downloaded repos and
        the catalog."""
        return list_models(self.home, self.cache_dir, [{**model.listing(), "state": state} for model, state in served],
                           created)

    def entry(self, name: str, served: list[tuple[LoadedModel, str]], created: int) -> dict[str, Any]:
        """GET /v1/models/{name}: the listed model the name refers to (a served model by any of its names)."""
        entries = self.listing(served, created)
        for entry in entries:
            if name in (entry["id"], entry.get("repo"), entry.get("path")):
                return entry
        for index, (model, _) in enumerate(served):
            if model.answers_to(name) or self._spelling_of(name, model):
                return entries[index]
        raise ModelNotFoundError(f"the model {name!r} does not exist: GET /v1/models lists the models")

    # -- internals ------------------------------------------------------------------------------------------

    def _find(self, text: str, keep: bool = True) -> LoadedModel | ModelName:
        """The cached model a name refers to (by this spelling, or by the canonical form of the name), else the
        name parsed, for the resolver. Raises ModelNotFoundError for a name that is none of the kinds."""
        known = self._models.get(self._keys.get(text, ""))
        if known is not None:
            return known
        name = self._hub_names.get(text) or parse_model_name(text, self.home)
        known = self._models.get(self._keys.get(name.canonical, ""))
        if known is None:
            return name
        if keep:
            self._keys[text] = known.key  # the next lookup by this spelling is one dictionary read
        return known

    def _find_quietly(self, text: str) -> LoadedModel | ModelName | None:
        """_find() for a request's name: None for one that is none of the kinds, and the spelling is not kept
        (clients may send any number of them)."""
        try:
            return self._find(text, keep=False)
        except ModelNotFoundError:
            return None

    def _spelling_of(self, text: str, model: LoadedModel) -> bool:
        found = self._find_quietly(text)
        return isinstance(found, LoadedModel) and found.key == model.key

    def _remember(self, model: LoadedModel, name: ModelName) -> LoadedModel:
        known = self._models.get(model.key)
        if known is not None:  # the same model by another name (a revision that resolved to the same commit)
            model = replace(known, aliases=known.aliases | model.aliases)
        self._models[model.key] = model  # first: a spelling must never name a key that is not here yet
        for spelling in model.aliases | {model.model_id, name.text, name.canonical}:
            self._keys.setdefault(spelling, model.key)  # a name two models share (a repo id) keeps the first
        self._keys[model.key] = model.key
        self._hub_names.pop(name.text, None)
        return model

    def _preparation(self, text: str) -> asyncio.Future[LoadedModel]:
        future = self._preparing.get(text)
        if future is None:
            future = asyncio.ensure_future(asyncio.to_thread(self.resolve, text))
            self._preparing[text] = future
            future.add_done_callback(lambda done: self._prepared(text, done))
        return future

    def _prepared(self, text: str, future: asyncio.Future[LoadedModel]) -> None:
        self._preparing.pop(text, None)
        if future.cancelled():
            return
        error = future.exception()
        if error is None:
            self._failures.pop(text, None)
        else:
            failure = error if isinstance(error, ExoLikeError) else ExoLikeError(f"{type(error).__name__}: {error}")
            self._failures[text] = (time.monotonic(), failure)
            log.error("node %s: cannot use model %s: %s", self.node_id, text, failure.message)
        self._on_prepared(text)

    def _pending(self, key: str) -> ExoLikeError:
        failure = self._failures.get(key)
        if failure is not None and time.monotonic() - failure[0] < RETRY_DESCRIBE_SECONDS:
            return failure[1]
        self._preparation(key)
        return ModelPendingError(f"node {self.node_id} is fetching the description of {key} (config, tokenizer "
                                 f"and layer sizes) from the hub")
