"""From a model's name to the model, in one pass: parse → locate → fetch metadata (hub) → describe.

1. parse and locate (name.py): the name's kind and parts; a local path or a packaged file is found on disk.
2. fetch (hub names only): the first repo of the name that works gives its commit and what planning needs, from
   the cache or the hub: a GGUF repo the picked file's headers (gguf/hub.py), a transformers repo its small files
   and the weight files' layer sizes (hub/repo.py).
3. describe: config, tokenizer and bytes per layer, as one LoadedModel.

The registry (model_registry.py) runs this once per name and caches the result; the node, the API, planning, the speed
probe, downloads and GET /v1/models all use that LoadedModel and never read the name again.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from huggingface_hub.file_download import REGEX_COMMIT_HASH

from exo_like.errors import ExoLikeError, HubUnavailableError, ModelNotFoundError, UnsupportedModelError
from exo_like.models.config import ModelArgs
from exo_like.models.demo import DEMO_NAME, ensure_demo_model
from exo_like.models.footprint import ModelDescription, ModelFootprint, model_footprint
from exo_like.models.gguf.file import is_gguf, open_gguf
from exo_like.models.gguf.hub import gguf_description, prepare_gguf_repo
from exo_like.models.gguf.select import with_tag
from exo_like.models.gguf.tokenizer import gguf_tokenizer
from exo_like.models.hub.repo import (
    NotTransformersRepoError,
    RepoManifest,
    cached_snapshot,
    download_metadata,
    repo_manifest,
)
from exo_like.models.names.catalog import PACKAGED, entry_for_repo
from exo_like.models.hub.peer_files import PeerSource, described_by_peers
from exo_like.models.names.name import ModelName, parse_model_name, pinned_key
from exo_like.models.parameters import count_parameters
from exo_like.models.shard import Shard
from exo_like.models.tensor_split import GGUF_GROUP, group_sizes, split_align
from exo_like.models.tokenizer import ModelTokenizer

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class LoadedModel:
    """A model this node can serve, described once: its id, the names that refer to it, and what describes it."""

    model_id: str
    key: str  # how peers name it: "demo", the folder's absolute path, or repo id@commit[:TAG] (HubModel.key)
    path: Path  # for a hub model: its snapshot folder in the cache, where the shard's weight files arrive (a GGUF
    # repo: the sparse first part of the file, where the shard's byte ranges arrive)
    args: ModelArgs
    tokenizer: ModelTokenizer
    footprint: ModelFootprint  # the bytes per layer (a hub model's: its manifest's)
    aliases: frozenset[str]  # names that refer to it without asking the hub
    named: ModelName  # the parsed name it was first resolved from
    manifest: RepoManifest | None = None  # hub models: the weight files and the bytes per layer
    created: int = field(default_factory=lambda: int(time.time()))

    @property
    def kind(self) -> str:
        """"demo", "local" or "hub"."""
        return self.named.kind

    @property
    def description(self) -> ModelDescription:
        """What planning needs."""
        # A quantized checkpoint splits on its quantization groups, and on torch nodes only (MLX's packed words
        # are not split yet).
        quantized = self.footprint.unpacked is not None
        quant = self.args.quant
        align = split_align((quant.group_size if quant else GGUF_GROUP) if quantized else None)
        return ModelDescription(self.args.num_hidden_layers, self.footprint, self.args.model_type,
                                count_parameters(self.args).to_json(), group_sizes(self.args, align),
                                ("torch",) if quantized else ("torch", "mlx"))

    def answers_to(self, name: str) -> bool:
        return name == self.model_id or name in self.aliases

    def to_json(self) -> dict[str, object]:
        return {"id": self.model_id, "object": "model", "created": self.created, "owned_by": "exo-like",
                "context_length": self.args.context_length, "architecture": self.args.model_type,
                "parameters": count_parameters(self.args).to_json(),
                "bytes": self.footprint.shard_bytes(Shard("whole", 0, self.args.num_hidden_layers,
                                                          self.args.num_hidden_layers))}

    def listing(self) -> dict[str, object]:
        """Its entry in GET /v1/models."""
        where = ({"source": "hub", "repo": self.manifest.repo_id, "revision": self.manifest.commit}
                 if self.manifest is not None else {"source": "local", "path": str(self.path.resolve())})
        return {**self.to_json(), **where}


@dataclass(frozen=True)
class HubModel:
    """What the hub (or the cache) gave for a hub name: the repo that worked, at one commit."""

    repo_id: str
    folder: Path  # the snapshot folder: small files now, weight files as the node's layers need them; for a
    # GGUF repo the (sparse) first part of the model file
    args: ModelArgs
    manifest: RepoManifest
    tag: str | None = None  # the GGUF quantization tag it was named with

    @property
    def commit(self) -> str:
        return self.manifest.commit

    @property
    def name(self) -> str:
        """The model's id: the repo, with the GGUF tag it was named with."""
        return with_tag(self.repo_id, self.tag)

    @property
    def key(self) -> str:
        return with_tag(pinned_key(self.repo_id, self.commit), self.tag)


def resolve_model(name: ModelName, home: Path, cache_dir: Path, peers: Sequence[PeerSource] = ()) -> LoadedModel:
    """The model a parsed name refers to, described. Blocking: a hub name may fetch from the hub (or the peers),
    so call this before the event loop runs or from a worker thread."""
    if name.kind == "hub":
        return describe_hub_model(_hub_or_peers(name, home, cache_dir, peers), name)
    return describe_local_model(name, home)


def _hub_or_peers(name: ModelName, home: Path, cache_dir: Path, peers: Sequence[PeerSource]) -> HubModel:
    """A hub name from the hub; when the hub cannot be used (unreachable, offline, --no-downloads), the commit a
    peer resolved it to, described by that peer."""
    try:
        return fetch_hub_model(name, cache_dir, peers)
    except HubUnavailableError:
        key = next((key for peer in peers if (key := peer.key_of(name.text)) is not None), None)
        pinned = parse_model_name(key, home) if key is not None else None
        if pinned is None or pinned.kind != "hub" or pinned.revision is None:
            raise
        log.info("%s: the hub cannot be used; a peer serves it as %s", name.text, key)
        return fetch_hub_model(pinned, cache_dir, peers)


# -- local models: demo, folders, GGUF files, packaged files ------------------------------------------------------


def describe_local_model(name: ModelName, home: Path) -> LoadedModel:
    path = ensure_demo_model(home) if name.kind == "demo" else name.path
    assert path is not None  # a local name is parsed with its path
    args, tokenizer, footprint = read_local_model(path)
    model_id = _local_model_id(name, path)
    key = DEMO_NAME if name.kind == "demo" else str(path)
    aliases = frozenset({name.text, name.canonical, model_id, str(path), key})
    return LoadedModel(model_id, key, path, args, tokenizer, footprint, aliases, name)


def _local_model_id(name: ModelName, path: Path) -> str:
    """demo, a packaged model's name, a GGUF file's stem, or a folder's name."""
    if name.kind == "demo":
        return DEMO_NAME
    if is_gguf(path):
        packaged = PACKAGED.get(name.text.strip().lower())
        return packaged.name if packaged else path.stem
    return path.name


def read_local_model(path: Path) -> tuple[ModelArgs, ModelTokenizer, ModelFootprint]:
    """Config, tokenizer and per-layer bytes of a local Hugging Face folder or GGUF file (headers only)."""
    if is_gguf(path):
        args, footprint = gguf_description(path)
        return args, read_tokenizer(path), footprint
    args = ModelArgs.from_dir(path)
    footprint = model_footprint(path, args.num_hidden_layers, args.tie_word_embeddings, args.quant)
    return args, read_tokenizer(path), footprint


def read_tokenizer(path: Path) -> ModelTokenizer:
    """A GGUF file's tokenizer from its header, or a Hugging Face folder's tokenizer files."""
    return gguf_tokenizer(open_gguf(path).metadata, path.name) if is_gguf(path) else ModelTokenizer.from_dir(path)


# -- hub models ---------------------------------------------------------------------------------------------------


def describe_hub_model(hub: HubModel, name: ModelName) -> LoadedModel:
    entry = entry_for_repo(hub.repo_id)
    aliases = {name.text, name.canonical, hub.repo_id, hub.name, hub.key} | ({entry.name} if entry else set())
    return LoadedModel(hub.name, hub.key, hub.folder, hub.args, read_tokenizer(hub.folder), hub.manifest.footprint,
                       frozenset(aliases), name, hub.manifest)


def fetch_hub_model(name: ModelName, cache_dir: Path, peers: Sequence[PeerSource] = ()) -> HubModel:
    """Fetch (or read from the cache) what planning needs, from the first of the name's repos that works.

    Repos already in the cache are tried first, so a catalog name keeps meaning the repo a node has."""
    repos = sorted(name.repos, key=lambda repo: cached_snapshot(cache_dir, repo) is None)
    failures: list[tuple[str, ExoLikeError]] = []
    for repo in repos:
        try:
            return _fetch_repo(repo, cache_dir, name.revision, name.tag, peers)
        except ExoLikeError as exc:
            if len(repos) == 1:
                raise
            log.warning("%s (for %s): %s", repo, name.text, exc.message)
            failures.append((repo, exc))
    first = failures[0][1]
    reasons = "; ".join(f"{repo}: {exc.message}" for repo, exc in failures)
    raise type(first)(f"no repo of {name.text!r} can be used: {reasons}", code=first.code)


def _fetch_repo(repo_id: str, cache_dir: Path, revision: str | None, tag: str | None,
                peers: Sequence[PeerSource]) -> HubModel:
    """A GGUF repo (named with a tag, or by a name ending in GGUF) by its file's headers; else a transformers repo
    by its small files and weight headers, falling back to its GGUF files when it has no config.json. A commit's
    description held here or by a peer is taken from there: a commit never changes."""
    if tag is not None or repo_id.lower().endswith("gguf"):
        return HubModel(repo_id, *prepare_gguf_repo(repo_id, cache_dir, revision, tag), tag=tag)
    pinned = revision is not None and REGEX_COMMIT_HASH.match(revision) is not None
    held = described_by_peers(cache_dir, repo_id, revision, peers) if revision is not None and pinned else None
    try:
        folder = held or download_metadata(repo_id, cache_dir, revision)
    except NotTransformersRepoError as not_transformers:
        try:
            return HubModel(repo_id, *prepare_gguf_repo(repo_id, cache_dir, revision, None))
        except ModelNotFoundError:
            raise not_transformers from None  # no GGUF model either: the repo is not a model this project serves
    try:
        args = ModelArgs.from_dir(folder)  # an unsupported architecture stops here, before any weights move
    except UnsupportedModelError as exc:
        raise UnsupportedModelError(f"{repo_id} cannot be served: {exc.message}; pick a model of a supported "
                                    f"family (GET /v1/models lists the catalog)", code=exc.code) from None
    manifest = repo_manifest(repo_id, folder, args.num_hidden_layers, args.tie_word_embeddings, cache_dir,
                             args.quant)
    return HubModel(repo_id, folder, args, manifest)
