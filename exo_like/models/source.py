"""What a model name refers to, and the models a node knows about.

A name is `demo`, a local Hugging Face folder or GGUF file (a path, or under <home>/models; a folder holding
one GGUF model counts as that file), a model shipped in a Python package (smollm2-135m), a catalog short name
(llama-3.2-1b, qwen2.5-7b, ...), or a hub repo id (organisation/name), optionally at a revision
(organisation/name@branch-tag-or-commit). A repo of GGUF files is named with a quantization tag as llama.cpp's
`-hf` takes it (organisation/name-GGUF:Q4_K_M, gguf/select.py); without one, a repo whose name ends in GGUF or
that has no config.json but GGUF files picks llama.cpp's default file. In the cluster a hub model is keyed by its
repo id and the commit the first node resolved it to (organisation/name@<commit>[:TAG]): every node fetches the
model itself, and that key makes them all fetch the same weights, even if the repo changes meanwhile or one
node's cache is older.
"""

from __future__ import annotations

import json
import logging
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from exo_like.errors import ExoLikeError, ModelNotFoundError, UnsupportedModelError
from exo_like.models.catalog import CATALOG, PACKAGED, CatalogEntry, entry_for_repo, lookup
from exo_like.models.checkpoint import INDEX_FILE, SINGLE_FILE
from exo_like.models.config import ModelArgs
from exo_like.models.demo import DEMO_NAME
from exo_like.models.gguf.file import find_gguf, is_later_part
from exo_like.models.gguf.hub import prepare_gguf_repo
from exo_like.models.gguf.select import split_tag, with_tag
from exo_like.models.hub.repo import (
    NotTransformersRepoError,
    RepoManifest,
    cached_snapshot,
    download_metadata,
    repo_manifest,
)

log = logging.getLogger(__name__)

# The hub's repo id rule: one slash, letters, digits, '-', '_', '.'; no '--' or '..'; not starting with '.'.
_REPO_ID = re.compile(r"^(?!.*(--|\.\.))[A-Za-z0-9][\w.-]{0,95}/[A-Za-z0-9][\w.-]{0,95}$")
# A git branch, tag or commit as the hub takes it in a URL path (branches may hold '/', e.g. refs/pr/1).
_REVISION = re.compile(r"^(?!.*\.\.)\w[\w./-]{0,199}$")


@dataclass(frozen=True)
class ModelSource:
    kind: str  # "demo" | "local" | "hub"
    spec: str
    folder: Path | None = None  # demo and local (a GGUF model: its file, the first part of a split one)
    repos: tuple[str, ...] = ()  # hub: candidates, tried in order
    catalog: CatalogEntry | None = None
    revision: str | None = None  # hub: a branch, tag or commit of the (single) repo; None: main
    tag: str | None = None  # hub: the quantization tag that picks a GGUF file of the repo (Q4_K_M)


@dataclass(frozen=True)
class HubModel:
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


def is_repo_id(text: str) -> bool:
    return bool(_REPO_ID.match(text))


def split_revision(spec: str) -> tuple[str, str | None]:
    """'org/name@rev' -> ('org/name', 'rev'); anything else -> (spec, None). Repo ids cannot hold '@'."""
    repo_id, at, revision = spec.partition("@")
    if at and is_repo_id(repo_id) and _REVISION.match(revision):
        return repo_id, revision
    return spec, None


def pinned_key(repo_id: str, commit: str) -> str:
    """The cluster's name for a hub model: the repo at the commit the first node resolved."""
    return f"{repo_id}@{commit}"


def locate(spec: str, home: Path) -> ModelSource:
    """Classify a model name without touching the network (local folders win over hub names)."""
    if spec == DEMO_NAME:
        return ModelSource("demo", spec)
    for candidate in (Path(spec).expanduser(), home / "models" / spec):
        if (candidate / "config.json").is_file():
            return ModelSource("local", spec, folder=candidate.resolve())
        gguf = find_gguf(candidate)
        if gguf is not None:  # not resolved: a split set's parts sit beside the link (the hub cache links blobs)
            return ModelSource("local", spec, folder=gguf.absolute())
    packaged = PACKAGED.get(spec.strip().lower())
    if packaged is not None:
        path = packaged.path()
        if path is None:
            raise ModelNotFoundError(packaged.missing_message())
        return ModelSource("local", spec, folder=path.absolute())
    entry = lookup(spec)
    if entry is not None:
        return ModelSource("hub", spec, repos=entry.repos, catalog=entry)
    named, tag = split_tag(spec)
    repo_id, revision = split_revision(named)
    if is_repo_id(repo_id):
        return ModelSource("hub", spec, repos=(repo_id,), catalog=entry_for_repo(repo_id), revision=revision,
                           tag=tag)
    raise ModelNotFoundError(
        f"model {spec!r} not found: give a Hugging Face repo id (organisation/name, optionally @revision, or "
        f"organisation/name-GGUF:Q4_K_M for a GGUF file), a "
        f"catalog name ({', '.join(list(CATALOG)[:4])}, ...: see GET /v1/models), a local model folder, or 'demo'")


def prepare_hub_model(source: ModelSource, cache_dir: Path) -> HubModel:
    """Fetch (or read from the cache) what planning needs, from the first of the source's repos that works.

    Repos already in the cache are tried first, so a catalog name keeps meaning the repo a node has."""
    repos = sorted(source.repos, key=lambda repo: cached_snapshot(cache_dir, repo) is None)
    failures: list[tuple[str, ExoLikeError]] = []
    for repo in repos:
        try:
            return _prepare_repo(repo, cache_dir, source.revision, source.tag)
        except ExoLikeError as exc:
            if len(repos) == 1:
                raise
            log.warning("%s (for %s): %s", repo, source.spec, exc.message)
            failures.append((repo, exc))
    first = failures[0][1]
    reasons = "; ".join(f"{repo}: {exc.message}" for repo, exc in failures)
    raise type(first)(f"no repo of {source.spec!r} can be used: {reasons}", code=first.code)


def _prepare_repo(repo_id: str, cache_dir: Path, revision: str | None = None, tag: str | None = None) -> HubModel:
    if tag is not None or repo_id.lower().endswith("gguf"):
        return HubModel(repo_id, *prepare_gguf_repo(repo_id, cache_dir, revision, tag), tag=tag)
    try:
        folder = download_metadata(repo_id, cache_dir, revision)
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


def list_models(home: Path, cache_dir: Path, served: dict[str, Any] | None, created: int) -> list[dict[str, Any]]:
    """GET /v1/models: the model being served first, then local folders, downloaded repos and the catalog."""
    entries = [*_local_entries(home), *_downloaded_entries(cache_dir), *_catalog_entries(cache_dir)]
    for entry in entries:
        entry.update({"object": "model", "created": created, "owned_by": "exo-like"})
    if served is None:
        return entries
    names = {served["id"], served.get("repo"), served.get("path")} - {None}
    others = [entry for entry in entries if entry["id"] not in names or entry["source"] == "catalog"]
    for entry in others:
        if entry.get("repo") in names:
            entry["state"] = "serving"  # the catalog name of the served repo
    return [{**served, "state": "serving"}, *others]


def _local_entries(home: Path) -> list[dict[str, Any]]:
    """What <home>/models holds that --model (or a request's `model`) takes by name: Hugging Face folders,
    GGUF files (a split set by its first part) and folders holding one GGUF model."""
    folder = home / "models"
    paths = sorted(folder.iterdir()) if folder.is_dir() else []
    return [{"id": path.name, "source": "local", "path": str(path.resolve()), "state": "local"}
            for path in paths if _is_local_model(path)]


def _is_local_model(path: Path) -> bool:
    if (path / "config.json").is_file():
        return True
    try:
        return find_gguf(path) is not None and not is_later_part(path)
    except ModelNotFoundError:  # a folder of several GGUF models: each is named by its file instead
        return False


def _downloaded_entries(cache_dir: Path) -> list[dict[str, Any]]:
    entries = []
    for storage in sorted(cache_dir.glob("models--*--*")) if cache_dir.is_dir() else []:
        repo_id = storage.name[len("models--"):].replace("--", "/", 1)
        folder = cached_snapshot(cache_dir, repo_id)
        if folder is not None:
            entries.append({"id": repo_id, "source": "hub", "repo": repo_id, **_cache_state(folder)})
    return entries


def _catalog_entries(cache_dir: Path) -> list[dict[str, Any]]:
    entries = []
    for entry in CATALOG.values():
        cached = [repo for repo in entry.repos if cached_snapshot(cache_dir, repo) is not None]
        state = _cache_state(cached_snapshot(cache_dir, cached[0])) if cached else {"state": "not_downloaded"}
        entries.append({"id": entry.name, "source": "catalog", **entry.to_json(), **state,
                        **({"repo": cached[0]} if cached else {})})
    return entries


def _cache_state(folder: Path | None) -> dict[str, Any]:
    """downloaded: every weight file is here; partial: some (a node holds its own layers' files only)."""
    if folder is None:
        return {"state": "not_downloaded"}
    index = folder / INDEX_FILE
    names = set(json.loads(index.read_text())["weight_map"].values()) if index.is_file() else {SINGLE_FILE}
    present = sum(1 for name in names if (folder / name).exists())
    state = "downloaded" if present == len(names) else "partial" if present else "not_downloaded"
    return {"state": state, "weight_files": len(names), "weight_files_present": present}
