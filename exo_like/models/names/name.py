"""What a model name says, read once and without the network (the first step of resolver.py).

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

import errno
import re
from dataclasses import dataclass
from pathlib import Path

from exo_like.errors import ModelNotFoundError
from exo_like.models.demo import DEMO_NAME
from exo_like.models.gguf.file import find_gguf
from exo_like.models.gguf.select import split_tag, with_tag
from exo_like.models.names.catalog import CATALOG, PACKAGED, CatalogEntry, entry_for_repo, lookup

# The hub's repo id rule: one slash, letters, digits, '-', '_', '.'; no '--' or '..'; not starting with '.'.
_REPO_ID = re.compile(r"^(?!.*(--|\.\.))[A-Za-z0-9][\w.-]{0,95}/[A-Za-z0-9][\w.-]{0,95}$")
# A git branch, tag or commit as the hub takes it in a URL path (branches may hold '/', e.g. refs/pr/1).
_REVISION = re.compile(r"^(?!.*\.\.)\w[\w./-]{0,199}$")


@dataclass(frozen=True)
class ModelName:
    """A name split into its parts once, so no later step splits, looks up or normalizes it again."""

    text: str  # as given
    kind: str  # "demo" | "local" | "hub"
    path: Path | None = None  # local: the folder, or the GGUF file (the first part of a split one)
    repo: str | None = None  # hub: the repo named; None for a catalog name, whose repos are tried in turn
    catalog: CatalogEntry | None = None  # hub: the catalog entry named, or the one the repo belongs to
    revision: str | None = None  # hub: a branch, tag or commit of the repo; None: main
    tag: str | None = None  # hub: the quantization tag (upper case) that picks a GGUF file of the repo

    @property
    def repos(self) -> tuple[str, ...]:
        """The hub repos to try, in order."""
        if self.repo is not None:
            return (self.repo,)
        return self.catalog.repos if self.catalog is not None else ()

    @property
    def canonical(self) -> str:
        """One spelling for all the ways of writing this name (a catalog name's case, a tag's case, a path
        relative to <home>/models): what the registry caches a model under besides the text it was given."""
        if self.kind == "demo":
            return DEMO_NAME
        if self.kind == "local":
            return str(self.path)
        if self.repo is None:
            assert self.catalog is not None
            return self.catalog.name
        return with_tag(self.repo if self.revision is None else pinned_key(self.repo, self.revision), self.tag)


def parse_model_name(text: str, home: Path) -> ModelName:
    """Classify a model name without touching the network (local folders win over hub names)."""
    if text == DEMO_NAME:
        return ModelName(text, "demo")
    path = _local_path(text, home)
    if path is not None:
        return ModelName(text, "local", path=path)
    packaged = PACKAGED.get(text.strip().lower())
    if packaged is not None:
        file = packaged.path()
        if file is None:
            raise ModelNotFoundError(packaged.missing_message())
        return ModelName(text, "local", path=file.absolute())
    entry = lookup(text)
    if entry is not None:
        return ModelName(text, "hub", catalog=entry)
    named, tag = split_tag(text)
    repo_id, revision = split_revision(named)
    if is_repo_id(repo_id):
        return ModelName(text, "hub", repo=repo_id, catalog=entry_for_repo(repo_id), revision=revision, tag=tag)
    raise ModelNotFoundError(
        f"model {text!r} not found: give a Hugging Face repo id (organisation/name, optionally @revision, or "
        f"organisation/name-GGUF:Q4_K_M for a GGUF file), a "
        f"catalog name ({', '.join(list(CATALOG)[:4])}, ...: see GET /v1/models), a local model folder, or 'demo'")


def _local_path(text: str, home: Path) -> Path | None:
    """The Hugging Face folder or GGUF file the text names, as a path or under <home>/models."""
    for candidate in (Path(text).expanduser(), home / "models" / text):
        try:
            if (candidate / "config.json").is_file():
                return candidate.resolve()
            gguf = find_gguf(candidate)
        except OSError as exc:
            if exc.errno != errno.ENAMETOOLONG:
                raise
            continue  # a request's `model` may be any text: one too long for a path names no local model
        if gguf is not None:  # not resolved: a split set's parts sit beside the link (the hub cache links blobs)
            return gguf.absolute()
    return None


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
