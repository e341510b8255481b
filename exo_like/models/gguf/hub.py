"""GGUF models from a hub repo (`org/name-GGUF:Q4_K_M`), fetched shard-only with HTTP Range requests.

Planning needs only the GGUF header (metadata with the tokenizer, and the tensor table), so a node first fetches
each part's header: a growing prefix of the file until the header parses (a real model's holds the vocabulary,
several MB), and then the few bytes of the tensors the config is made of (Llama 3.1's `rope_freqs`). Config,
tokenizer, chat template and the bytes per layer then come from these as for a local file. Later the node fetches
only its own tensors' byte ranges (download.py).

Both land in a sparse file of the part's full size (sparse_file.py) under the repo's cache folder,
`models--org--name/exo-like/gguf/<commit>/<path in the repo>`, so the local GGUF reader opens it unchanged. It
is not put into blobs/ or snapshots/: other Hugging Face tools would take it for the whole file. The repo's file
list at each commit is kept beside it, and refs/<revision> as huggingface_hub writes it, so a node restarted
with HF_HUB_OFFLINE=1 serves what it holds. A partial file cannot be checked against the LFS SHA-256 of the
whole file: only sizes are verified (every response's Content-Range, and the file's size).
"""

from __future__ import annotations

import json
import logging
import os
import re
from collections.abc import Callable
from pathlib import Path

from filelock import FileLock
from huggingface_hub import HfApi, hf_hub_url
from huggingface_hub.utils import build_hf_headers, get_session, hf_raise_for_status

from exo_like.errors import DownloadError, UnsupportedModelError
from exo_like.models.config import ModelArgs
from exo_like.models.footprint import ModelFootprint, footprint_from_matrices, gguf_matrices
from exo_like.models.gguf.file import CONFIG_TENSORS, GGUFCheckpoint, open_gguf
from exo_like.models.gguf.header import header_end
from exo_like.models.gguf.select import pick_gguf
from exo_like.models.hub.repo import (
    LIBRARY,
    MANIFEST_FOLDER,
    RemoteFile,
    RepoManifest,
    endpoint,
    hub_errors,
    not_cached_error,
    offline,
    storage_folder,
)
from exo_like.models.hub.sparse_file import Range, SparseFile, coalesce

log = logging.getLogger(__name__)

FIRST_PEEK = 256 << 10  # the first header request; each further one doubles what is held
STREAM_CHUNK = 1 << 20
RECORD_EVERY = 16 << 20  # bytes of a long range written between updates of the record (what a restart keeps)
_COMMIT = re.compile(r"^[0-9a-f]{40}$")


def gguf_folder(cache_dir: Path, repo_id: str, commit: str) -> Path:
    return storage_folder(cache_dir, repo_id) / MANIFEST_FOLDER / "gguf" / commit


def prepare_gguf_repo(repo_id: str, cache_dir: Path, revision: str | None, tag: str | None
                      ) -> tuple[Path, ModelArgs, RepoManifest]:
    """(local first part, config, manifest) of the GGUF model the tag picks, with every part's header here."""
    commit, listed = repo_files(repo_id, cache_dir, revision)
    names = pick_gguf(list(listed), tag, repo_id)
    folder = gguf_folder(cache_dir, repo_id, commit)
    for name in names:
        ensure_header(repo_id, commit, name, listed[name], folder / name, cache_dir)
    gguf = open_gguf(folder / names[0])
    ensure_config_tensors(repo_id, commit, listed, folder, gguf, cache_dir)
    args, footprint = describe(gguf)
    log.info("%s@%s: GGUF %s (%d part%s, %.1f MB): planned from its header", repo_id, commit[:8], names[0], len(names),
             "" if len(names) == 1 else "s", sum(listed[n].size for n in names) / 1e6)
    return folder / names[0], args, RepoManifest(repo_id, commit, {n: listed[n] for n in names}, footprint)


def gguf_description(path: Path) -> tuple[ModelArgs, ModelFootprint]:
    """Config and per-layer bytes of a GGUF model, from its header (and its config tensors)."""
    return describe(open_gguf(path))


def describe(gguf: GGUFCheckpoint) -> tuple[ModelArgs, ModelFootprint]:
    args = ModelArgs.from_dict(gguf.config())
    matrices = gguf_matrices((n, e.type_name, e.n_bytes, e.shape) for n, e in gguf.tensors.items())
    return args, footprint_from_matrices(matrices, args.num_hidden_layers, args.tie_word_embeddings)


def repo_files(repo_id: str, cache_dir: Path, revision: str | None) -> tuple[str, dict[str, RemoteFile]]:
    """(commit, the repo's .gguf files) at the revision: from the hub, or from the cache when offline."""
    storage = storage_folder(cache_dir, repo_id)
    if offline():
        commit = revision if revision and _COMMIT.match(revision) else _read(storage / "refs" / (revision or "main"))
        listing = _read(storage / MANIFEST_FOLDER / f"{commit}.gguf-files.json") if commit else None
        if listing is None:
            raise not_cached_error(repo_id, cache_dir, "the file list", RuntimeError("offline"))
        return str(commit), {n: RemoteFile(f["size"], f["sha256"]) for n, f in json.loads(listing).items()}
    with hub_errors(repo_id, cache_dir, "the file list", revision):
        info = HfApi(endpoint=endpoint(), **LIBRARY).model_info(repo_id, revision=revision, files_metadata=True)
    commit = str(info.sha)
    listed = {s.rfilename: RemoteFile(s.lfs.size if s.lfs else int(s.size or 0), s.lfs.sha256 if s.lfs else None)
              for s in info.siblings or [] if s.rfilename.endswith(".gguf")}
    _write(storage / MANIFEST_FOLDER / f"{commit}.gguf-files.json",
           json.dumps({n: {"size": f.size, "sha256": f.sha256} for n, f in listed.items()}))
    if revision != commit:
        _write(storage / "refs" / (revision or "main"), commit)
    return commit, listed


def ensure_header(repo_id: str, commit: str, name: str, remote: RemoteFile, path: Path, cache_dir: Path) -> None:
    """The part's header in its sparse file: grow a prefix until it parses, then write exactly the header."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with FileLock(str(path) + ".lock"):
        sparse = SparseFile(path, remote.size)
        if sparse.header_end is not None:
            return
        if offline():
            raise not_cached_error(repo_id, cache_dir, f"the header of {name}", RuntimeError("offline"))
        url = hf_hub_url(repo_id, name, revision=commit, endpoint=endpoint())
        prefix = b""
        with hub_errors(repo_id, cache_dir, f"the header of {name}"):
            while (end := header_end(prefix, name)) is None:
                if len(prefix) == remote.size:
                    raise UnsupportedModelError(f"{name} of {repo_id} ends inside its GGUF header",
                                                code="unsupported_weights")
                upto = min(remote.size, max(FIRST_PEEK, 2 * len(prefix)))
                prefix += read_range(url, (len(prefix), upto), remote.size)
        # Bytes past the header (the last request overshoots) are dropped: they may be another node's tensors.
        sparse.write(0, prefix[:end])
        sparse.mark(0, end, header=True)
        log.info("%s@%s: %s: header of %d bytes fetched in %d bytes", repo_id, commit[:8], name, end, len(prefix))


def ensure_config_tensors(repo_id: str, commit: str, listed: dict[str, RemoteFile], folder: Path,
                          gguf: GGUFCheckpoint, cache_dir: Path) -> None:
    """The few bytes of the tensors the config is read from (a `rope_freqs` of head_dim / 2 floats), fetched with
    the headers: every node needs them to plan and every stage to rotate, whatever layers it holds."""
    for part, ranges in shard_ranges(gguf, lambda name: name in CONFIG_TENSORS).items():
        name = part.relative_to(folder).as_posix()
        if offline():
            if SparseFile(part, listed[name].size).missing(ranges):
                raise not_cached_error(repo_id, cache_dir, f"the rope frequencies of {name}", RuntimeError("offline"))
            continue
        with hub_errors(repo_id, cache_dir, f"the rope frequencies of {name}"):
            fetch_ranges(repo_id, commit, name, listed[name], part, ranges, lambda _count: None)


def read_range(url: str, span: Range, size: int) -> bytes:
    """The bytes [start, end) of the remote file of `size` bytes, in one request."""
    chunks: list[bytes] = []
    stream_range(url, span, size, chunks.append)
    return b"".join(chunks)


def stream_range(url: str, span: Range, size: int, on_chunk: Callable[[bytes], None]) -> None:
    """GET [start, end) with a Range header, handing over the body piece by piece; sizes are checked."""
    start, end = span
    headers = {**build_hf_headers(**LIBRARY), "Range": f"bytes={start}-{end - 1}"}
    with get_session().stream("GET", url, headers=headers, follow_redirects=True) as response:
        hf_raise_for_status(response)
        if response.status_code != 206 or _range_total(response.headers.get("Content-Range")) != size:
            raise DownloadError(f"{url} did not answer the range {start}-{end - 1} of its {size} bytes "
                                f"({response.status_code}, Content-Range {response.headers.get('Content-Range')})",
                                code="download_failed")
        received = 0
        for chunk in response.iter_bytes(STREAM_CHUNK):
            on_chunk(chunk[:end - start - received])
            received += len(chunk)
    if received != end - start:
        raise DownloadError(f"{url} sent {received} of the {end - start} bytes asked for ({start}-{end - 1})",
                            code="download_failed")


def fetch_ranges(repo_id: str, commit: str, name: str, remote: RemoteFile, path: Path, wanted: list[Range],
                 on_bytes: Callable[[int], None]) -> None:
    """Bring the wanted ranges of one part into its sparse file, fetching only what its record lacks.

    No SHA-256 check is possible here: the LFS hash covers the whole file, and a node holds only its ranges."""
    url = hf_hub_url(repo_id, name, revision=commit, endpoint=endpoint())
    # Nodes sharing a cache must not write one part at once; a transfer for an older plan stops at its next
    # chunk and lets go, and then this one re-reads the record.
    with FileLock(str(path) + ".lock"):
        sparse = SparseFile(path, remote.size)
        for span in sparse.missing(wanted):
            _fetch_span(url, sparse, span, on_bytes)


def _fetch_span(url: str, sparse: SparseFile, span: Range, on_bytes: Callable[[int], None]) -> None:
    start, end = span
    position, recorded = start, start

    def write(chunk: bytes) -> None:
        nonlocal position, recorded
        on_bytes(len(chunk))  # first: it may stop the transfer, and then the chunk is not written
        sparse.write(position, chunk)
        position += len(chunk)
        if position - recorded >= RECORD_EVERY:
            sparse.mark(recorded, position)
            recorded = position

    try:
        stream_range(url, span, sparse.size, write)
    finally:
        if position > recorded:  # what arrived before a stop or a failure is kept
            sparse.mark(recorded, position)


def shard_ranges(gguf: GGUFCheckpoint, wanted: Callable[[str], bool]) -> dict[Path, list[Range]]:
    """Byte ranges per part of the tensors `wanted` names, merged where only alignment padding lies between."""
    alignment = int(gguf.metadata.get("general.alignment", 32))
    spans: dict[Path, list[Range]] = {part: [] for part in gguf.parts}
    for name, entry in gguf.tensors.items():
        if wanted(name):
            spans[entry.part].append((entry.offset, entry.offset + entry.n_bytes))
    return {part: coalesce(r, alignment - 1) for part, r in spans.items() if r}


def _range_total(content_range: str | None) -> int | None:
    match = re.match(r"bytes \d+-\d+/(\d+)$", content_range or "")
    return int(match.group(1)) if match else None


def _read(path: Path) -> str | None:
    return path.read_text().strip() if path.is_file() else None


def _write(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    temporary = path.with_name(f"{path.name}.{os.getpid()}.tmp")
    temporary.write_text(text)
    os.replace(temporary, path)
