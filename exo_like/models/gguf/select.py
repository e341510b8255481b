"""Which GGUF file of a hub repo a name picks: `org/name-GGUF:Q4_K_M`, as llama.cpp's `-hf` and Ollama's `hf.co/`
names read.

The rules are llama.cpp's (common/download.cpp, find_best_model): the tag matches a file whose path holds the tag
followed by '.' or '-', case-insensitively (`x-Q4_K_M.gguf`, `Q4_K_M/x-Q4_K_M-00001-of-00003.gguf`); of a split
set only the first part is a candidate, and the set is every part with the same stem and count. Without a tag:
Q4_K_M, else Q8_0, else the first model file. Side files (a vision projector, an importance matrix, draft
models) are never the model. Paths are taken in sorted order, as the hub lists them.
"""

from __future__ import annotations

import re

from exo_like.errors import ModelNotFoundError

GGUF_SUFFIX = ".gguf"
DEFAULT_TAGS = ("Q4_K_M", "Q8_0")
# What a quantization tag may look like in a name (Q4_K_M, q8_0, UD-Q4_K_XL, BF16, IQ2_XXS).
_TAG = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.+-]{0,63}$")
_SPLIT = re.compile(r"^(?P<prefix>.+)-(?P<index>\d{5})-of-(?P<count>\d{5})$", re.IGNORECASE)
_FILE_TAG = re.compile(r"[-.]([A-Z0-9_]+)$", re.IGNORECASE)
_NOT_MODELS = ("mmproj", "imatrix", "mtp-", "eagle3-", "dflash-", "dspark-")


def split_tag(spec: str) -> tuple[str, str | None]:
    """'org/name[@rev]:tag' -> ('org/name[@rev]', 'TAG'); anything else -> (spec, None). Tags match file names
    case-insensitively, so they are upper-cased: every spelling names the same model."""
    head, colon, tag = spec.rpartition(":")
    if colon and "/" in head and _TAG.match(tag):
        return head, tag.upper()
    return spec, None


def with_tag(name: str, tag: str | None) -> str:
    return name if tag is None else f"{name}:{tag}"


def pick_gguf(paths: list[str], tag: str | None, repo_id: str) -> list[str]:
    """The repo paths of the model file the tag picks: one file, or every part of a split set in order."""
    models = sorted(p for p in paths if _is_model(p))
    for wanted in [tag] if tag else DEFAULT_TAGS:
        pattern = re.compile(re.escape(wanted) + r"[.-]", re.IGNORECASE)
        found = next((p for p in models if pattern.search(p) and _split_info(p)[1] == 1), None)
        if found is not None:
            return _split_set(models, found, repo_id)
    firsts = [p for p in models if _split_info(p)[1] == 1]
    if tag is None and firsts:
        return _split_set(models, firsts[0], repo_id)
    if not models:
        raise ModelNotFoundError(f"the repo {repo_id} holds no GGUF model file")
    raise ModelNotFoundError(f"the repo {repo_id} has no GGUF file tagged {tag!r}; tags available: "
                             f"{', '.join(available_tags(models))}")


def available_tags(paths: list[str]) -> list[str]:
    """The quantization tags of the repo's model files (upper case), as `repo:TAG` names them."""
    tags = {_split_info(p)[3] for p in paths if _is_model(p)}
    return sorted(t for t in tags if t)


def _split_set(models: list[str], first: str, repo_id: str) -> list[str]:
    prefix, _, count, _ = _split_info(first)
    if count == 1:
        return [first]
    parts = sorted((p for p in models if _split_info(p)[0] == prefix and _split_info(p)[2] == count),
                   key=lambda p: _split_info(p)[1])
    if [_split_info(p)[1] for p in parts] != list(range(1, count + 1)):
        raise ModelNotFoundError(f"the split GGUF model {first} of {repo_id} lacks some of its {count} parts")
    return parts


def _split_info(path: str) -> tuple[str, int, int, str]:
    """(prefix, index, count, tag) of a .gguf path: `a/x-Q4_K_M-00002-of-00003.gguf` -> ('a/x-Q4_K_M', 2, 3,
    'Q4_K_M'); a single file is part 1 of 1."""
    prefix = path[:-len(GGUF_SUFFIX)]
    index = count = 1
    match = _SPLIT.match(prefix)
    if match:
        prefix, index, count = match["prefix"], int(match["index"]), int(match["count"])
    tag = _FILE_TAG.search(prefix)
    return prefix, index, count, tag.group(1).upper() if tag else ""


def _is_model(path: str) -> bool:
    name = path.rsplit("/", 1)[-1]
    return path.endswith(GGUF_SUFFIX) and not any(word in name for word in _NOT_MODELS)
