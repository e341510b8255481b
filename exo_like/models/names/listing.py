"""GET /v1/models: what a node can serve by name, read from disk on each call (downloads change it).

The served model first (as the registry resolved it), then what <home>/models holds, the repos in the hub cache
and the catalog, each with its `state`.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from exo_like.errors import ModelNotFoundError
from exo_like.models.checkpoint import INDEX_FILE, SINGLE_FILE
from exo_like.models.gguf.file import find_gguf, is_later_part
from exo_like.models.hub.repo import cached_snapshot
from exo_like.models.names.catalog import CATALOG, PACKAGED


def list_models(home: Path, cache_dir: Path, served: list[dict[str, Any]], created: int) -> list[dict[str, Any]]:
    """GET /v1/models: the models the cluster serves first (each entry with its `state`: serving, or loading), then
    local folders, downloaded repos and the catalog."""
    entries = [*_packaged_entries(), *_local_entries(home), *_downloaded_entries(cache_dir),
               *_catalog_entries(cache_dir)]
    for entry in entries:
        entry.update({"object": "model", "created": created, "owned_by": "exo-like"})
    names: dict[str, str] = {}  # every name of a served model -> its state
    for model in served:
        for name in {model["id"], model.get("repo"), model.get("path")} - {None}:
            names.setdefault(name, model["state"])
    others = [entry for entry in entries if entry["id"] not in names or entry["source"] == "catalog"]
    for entry in others:
        if entry.get("repo") in names:
            entry["state"] = names[entry["repo"]]  # the catalog name of a served repo
    return [*({"object": "model", "created": created, "owned_by": "exo-like", **model} for model in served), *others]


def _packaged_entries() -> list[dict[str, Any]]:
    """The models shipped in Python packages that are installed here (smollm2-135m)."""
    return [{"id": name, "source": "packaged", "path": str(path), "state": "local"}
            for name, packaged in PACKAGED.items() if (path := packaged.path()) is not None]


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
