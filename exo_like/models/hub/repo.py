"""The Hugging Face hub, through huggingface_hub: a repo's small files, and what its weight files hold.

Every node fetches for itself, so the cluster's model key is the repo id. What a node needs before it can plan
comes first and is small: config, tokenizer, the safetensors index, and the bytes of every layer (read from the
safetensors headers with HTTP Range requests, a few KB per file). The weights a node's layers need are fetched
afterwards (download.py).

huggingface_hub itself reads HF_ENDPOINT (a mirror, or a test server), HF_TOKEN (gated and private repos) and
HF_HUB_OFFLINE (cache only). Files go into the standard hub cache layout (models--org--name/{blobs,snapshots,
refs}), so other Hugging Face tools pointed at the same folder see them.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx2  # huggingface_hub 2.x's HTTP client: its transport errors mean the hub cannot be reached
from huggingface_hub import HfApi, constants, get_token, snapshot_download
from huggingface_hub.errors import (
    GatedRepoError,
    HfHubHTTPError,
    LocalEntryNotFoundError,
    OfflineModeIsEnabled,
    RepositoryNotFoundError,
    RevisionNotFoundError,
)
from huggingface_hub.file_download import repo_folder_name

from exo_like import __version__
from exo_like.errors import (
    ExoLikeError,
    HubUnavailableError,
    ModelAccessError,
    ModelNotFoundError,
    UnsupportedModelError,
)
from exo_like.models.checkpoint import INDEX_FILE, SINGLE_FILE
from exo_like.models.footprint import ModelFootprint, footprint_from_tensors, model_footprint
from exo_like.models.quantization import QuantSpec

log = logging.getLogger(__name__)

LIBRARY = {"library_name": "exo-like", "library_version": __version__}
# Everything a node reads before it holds any weights. Newer repos keep the chat template in its own file.
META_FILES = ["config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json",
              "special_tokens_map.json", "chat_template.jinja", "chat_template.json", INDEX_FILE]
MANIFEST_FOLDER = "exo-like"  # inside the repo's cache folder, beside blobs/ and snapshots/ (which tools ignore)
HEADER_WORKERS = 8


def default_cache_dir(home: Path, configured: Path | None = None) -> Path:
    """--hub-cache if given, else HF_HUB_CACHE if set, else <home>/hub.

    By default a node keeps its downloads in its own home (one folder to inspect or delete); setting
    HF_HUB_CACHE shares the cache with other Hugging Face tools on purpose."""
    if configured is not None:
        return configured.expanduser().resolve()
    if os.environ.get("HF_HUB_CACHE"):
        return Path(os.environ["HF_HUB_CACHE"]).expanduser().resolve()
    return (home / "hub").resolve()


def offline() -> bool:
    return constants.is_offline_mode()


def refuse_downloads() -> None:
    """--no-downloads: this process serves only what its cache holds (huggingface_hub's offline mode, which also
    makes its client refuse every request), and errors say so in the option's words."""
    global _NO_DOWNLOADS
    _NO_DOWNLOADS = True
    constants.HF_HUB_OFFLINE = True


_NO_DOWNLOADS = False


def cache_only() -> tuple[str, str]:
    """Why this node serves from its cache only, and how to let it download: for error messages."""
    if _NO_DOWNLOADS:
        return "this node runs with --no-downloads", "start it without --no-downloads"
    return "HF_HUB_OFFLINE is set", "unset HF_HUB_OFFLINE"


def endpoint() -> str:
    """The hub's address: HF_ENDPOINT as it is now (huggingface_hub reads it once, at import)."""
    return os.environ.get("HF_ENDPOINT", "").rstrip("/") or constants.ENDPOINT


def storage_folder(cache_dir: Path, repo_id: str) -> Path:
    return cache_dir / repo_folder_name(repo_id=repo_id, repo_type="model")


def cached_snapshot(cache_dir: Path, repo_id: str) -> Path | None:
    """The snapshot folder `main` points to in the cache, if the repo was fetched before."""
    ref = storage_folder(cache_dir, repo_id) / "refs" / "main"
    if not ref.is_file():
        return None
    folder = storage_folder(cache_dir, repo_id) / "snapshots" / ref.read_text().strip()
    return folder if (folder / "config.json").is_file() else None


@dataclass(frozen=True)
class RemoteFile:
    size: int
    sha256: str | None  # from the LFS metadata; None for files stored in git itself


@dataclass(frozen=True)
class RepoManifest:
    """What a repo's weights are at one commit: each weight file's size and hash, and the bytes per layer."""

    repo_id: str
    commit: str
    files: dict[str, RemoteFile]  # the safetensors weight files only, or the parts of one GGUF model
    footprint: ModelFootprint

    @property
    def total_bytes(self) -> int:
        return sum(f.size for f in self.files.values())

    @property
    def gguf(self) -> bool:
        """A GGUF model (its files are the parts of one .gguf model, fetched by byte range)."""
        return all(name.endswith(".gguf") for name in self.files)

    def to_json(self) -> dict[str, Any]:
        return {"repo_id": self.repo_id, "commit": self.commit, "footprint": self.footprint.to_json(),
                "files": {name: {"size": f.size, "sha256": f.sha256} for name, f in self.files.items()}}

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> "RepoManifest":
        files = {name: RemoteFile(int(f["size"]), f["sha256"]) for name, f in data["files"].items()}
        return cls(data["repo_id"], data["commit"], files, ModelFootprint.from_json(data["footprint"]))


def download_metadata(repo_id: str, cache_dir: Path, revision: str | None = None) -> Path:
    """The snapshot folder holding the repo's small files at `revision` (default main), fetched or from the
    cache when offline. The folder's name is the commit."""
    with hub_errors(repo_id, cache_dir, "the description", revision):
        folder = Path(snapshot_download(repo_id, revision=revision, cache_dir=cache_dir, allow_patterns=META_FILES,
                                        local_files_only=offline(), endpoint=endpoint(), **LIBRARY))
    if not (folder / "config.json").is_file():
        raise NotTransformersRepoError(f"{repo_id} has no config.json: it is not a transformers model repo",
                                       code="unsupported_architecture")
    return folder


class NotTransformersRepoError(UnsupportedModelError):
    """The repo has no config.json (it may hold GGUF files instead)."""


def repo_manifest(repo_id: str, folder: Path, n_layers: int, tied: bool, cache_dir: Path,
                  quant: QuantSpec | None = None) -> RepoManifest:
    """The repo's weight files and per-layer bytes at the snapshot's commit: from the cache, else the hub."""
    commit = folder.name
    path = manifest_path(cache_dir, repo_id, commit)
    if path.is_file():
        return RepoManifest.from_json(json.loads(path.read_text()))
    if offline():
        manifest = _local_manifest(repo_id, folder, n_layers, tied, cache_dir, quant)
    else:
        with hub_errors(repo_id, cache_dir, "the layer sizes"):
            manifest = _fetch_manifest(repo_id, commit, folder, n_layers, tied, quant)
    save_manifest(cache_dir, manifest)
    return manifest


def manifest_path(cache_dir: Path, repo_id: str, commit: str) -> Path:
    return storage_folder(cache_dir, repo_id) / MANIFEST_FOLDER / f"{commit}.json"


def save_manifest(cache_dir: Path, manifest: RepoManifest) -> None:
    path = manifest_path(cache_dir, manifest.repo_id, manifest.commit)
    path.parent.mkdir(parents=True, exist_ok=True)
    temporary = path.with_name(f"{path.name}.{os.getpid()}.tmp")
    temporary.write_text(json.dumps(manifest.to_json()))
    os.replace(temporary, path)  # atomic: a node sharing the cache never reads half a manifest


def blob_path(cache_dir: Path, repo_id: str, sha256: str, suffix: str = "") -> Path:
    return storage_folder(cache_dir, repo_id) / "blobs" / f"{sha256}{suffix}"


def link_blob(blob: Path, pointer: Path) -> None:
    """snapshots/<commit>/<name> -> ../../blobs/<sha256>, as huggingface_hub lays out its cache."""
    pointer.parent.mkdir(parents=True, exist_ok=True)
    temporary = pointer.with_name(f"{pointer.name}.{os.getpid()}.link")
    try:
        os.symlink(os.path.relpath(blob, pointer.parent), temporary)
    except OSError:
        shutil.copyfile(blob, temporary)  # no symlinks on this filesystem
    os.replace(temporary, pointer)


def _fetch_manifest(repo_id: str, commit: str, folder: Path, n_layers: int, tied: bool,
                    quant: QuantSpec | None) -> RepoManifest:
    api = HfApi(endpoint=endpoint(), **LIBRARY)
    info = api.model_info(repo_id, revision=commit, files_metadata=True)
    listed = {s.rfilename: RemoteFile(s.lfs.size if s.lfs else int(s.size or 0), s.lfs.sha256 if s.lfs else None)
              for s in info.siblings or []}
    names = _weight_files(folder, listed)
    with ThreadPoolExecutor(HEADER_WORKERS, thread_name_prefix="headers") as pool:
        headers = list(pool.map(lambda name: api.parse_safetensors_file_metadata(repo_id, name, revision=commit),
                                names))
    tensors = ((name, tensor.dtype, tensor.data_offsets[1] - tensor.data_offsets[0], tuple(tensor.shape))
               for header in headers for name, tensor in header.tensors.items())
    log.info("%s@%s: %d weight files, %.1f MB; layer sizes read from their headers", repo_id, commit[:8],
             len(names), sum(listed[n].size for n in names) / 1e6)
    return RepoManifest(repo_id, commit, {n: listed[n] for n in names},
                        footprint_from_tensors(tensors, n_layers, tied, quant))


def _weight_files(folder: Path, listed: dict[str, RemoteFile]) -> list[str]:
    """The safetensors files named by the index, or the single model.safetensors."""
    if (folder / INDEX_FILE).is_file():
        names = sorted(set(json.loads((folder / INDEX_FILE).read_text())["weight_map"].values()))
    elif SINGLE_FILE in listed:
        names = [SINGLE_FILE]
    else:
        raise UnsupportedModelError(f"{folder.parent.parent.name} has no safetensors weights "
                                    f"({INDEX_FILE} or {SINGLE_FILE}); other formats are not supported",
                                    code="unsupported_weights")
    absent = [n for n in names if n not in listed]
    if absent:
        raise UnsupportedModelError(f"the safetensors index names files the repo lacks: {', '.join(absent)}",
                                    code="unsupported_weights")
    return names


def _local_manifest(repo_id: str, folder: Path, n_layers: int, tied: bool, cache_dir: Path,
                    quant: QuantSpec | None) -> RepoManifest:
    """Offline, without a saved manifest: only a cache that holds every weight file can describe the model."""
    present = {p.name: RemoteFile(p.stat().st_size, None) for p in folder.glob("*.safetensors")}
    try:
        names = _weight_files(folder, present)
    except UnsupportedModelError:
        names = []  # some weight files are missing here, so their headers cannot be read
    if not names:
        why, remedy = cache_only()
        raise HubUnavailableError(
            f"{why} and the cache {cache_dir} does not hold the layer sizes of {repo_id}: {remedy} so the node can "
            f"read them from the hub", code="model_not_cached")
    return RepoManifest(repo_id, folder.name, {n: present[n] for n in names},
                        model_footprint(folder, n_layers, tied, quant))


@contextmanager
def hub_errors(repo_id: str, cache_dir: Path, what: str, revision: str | None = None) -> Iterator[None]:
    """Turn huggingface_hub's errors into ones that name the cause and what to do about it."""
    try:
        yield
    except GatedRepoError:
        raise gated_error(repo_id) from None
    except RepositoryNotFoundError:
        raise ModelNotFoundError(f"model repo {repo_id!r} was not found on {endpoint()} (404): check the repo id "
                                 f"(organisation/name), or set HF_TOKEN if the repo is private") from None
    except RevisionNotFoundError:
        raise ModelNotFoundError(f"model repo {repo_id!r} has no revision {revision or 'main'!r} on {endpoint()}"
                                 ) from None
    except (LocalEntryNotFoundError, OfflineModeIsEnabled) as exc:
        raise not_cached_error(_at(repo_id, revision), cache_dir, what, exc) from None
    except HfHubHTTPError as exc:
        raise http_error(repo_id, what, exc) from None
    except httpx2.TransportError as exc:
        raise not_cached_error(_at(repo_id, revision), cache_dir, what, exc) from None


def _at(repo_id: str, revision: str | None) -> str:
    return repo_id if revision is None else f"{repo_id}@{revision}"


def gated_error(repo_id: str) -> ExoLikeError:
    holder = "the token in HF_TOKEN has not been granted access" if get_token() else "this node has no token"
    return ModelAccessError(f"{repo_id} is a gated model and {holder} (the hub answered 401): accept its terms "
                            f"at {endpoint()}/{repo_id} and start the node with HF_TOKEN set to a token of that "
                            f"account, or pick an ungated repo of the same model", code="gated_model")


def http_error(repo_id: str, what: str, exc: HfHubHTTPError) -> ExoLikeError:
    status = exc.response.status_code if exc.response is not None else 0
    if status in (401, 403):
        return ModelAccessError(f"the hub at {endpoint()} refused access to {repo_id} ({status}): check that "
                                f"HF_TOKEN holds a valid token with access to it", code="hub_access_denied")
    return HubUnavailableError(f"the hub at {endpoint()} answered {status} for {what} of {repo_id}: try again "
                               f"later (a partly downloaded file resumes where it stopped)", code="hub_error")


def not_cached_error(repo_id: str, cache_dir: Path, what: str, cause: BaseException) -> ExoLikeError:
    if offline():
        why, remedy = cache_only()
        return HubUnavailableError(
            f"{why} and the cache {cache_dir} does not hold {what} of {repo_id}: {remedy} so the node can download "
            f"it, or fill that cache first", code="model_not_cached")
    reason = _root_cause(cause)
    return HubUnavailableError(
        f"cannot reach the hub at {endpoint()} ({reason}) and the cache {cache_dir} does not hold {what} of "
        f"{repo_id}: check the network (or HF_ENDPOINT), or run with HF_HUB_OFFLINE=1 from a cache that holds it",
        code="hub_unreachable")


def _root_cause(exc: BaseException) -> str:
    while exc.__cause__ is not None:
        exc = exc.__cause__
    return f"{type(exc).__name__}: {exc}".splitlines()[0]


def delete_revision(cache_dir: Path, repo_id: str, commit: str) -> bool:
    """Remove a repo's commit from the cache (its snapshot, and the blobs no other commit uses); whether it was
    there."""
    from huggingface_hub import scan_cache_dir
    from huggingface_hub.errors import CacheNotFound

    try:
        info = scan_cache_dir(cache_dir)
    except CacheNotFound:
        return False
    for repo in info.repos:
        if repo.repo_id == repo_id and any(revision.commit_hash == commit for revision in repo.revisions):
            info.delete_revisions(commit).execute()
            return True
    return False
