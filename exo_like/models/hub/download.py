"""Shard-only downloads: the weight files this node's layers need, in parallel, resumable and verified.

Which files: those the safetensors index maps the shard's layers to, plus the embedding file on the first stage
and the final norm / LM head file on the last (checkpoint.files_for_shard). A file already in the cache is
never fetched again, so a new plan only fetches what the new range adds.

A GGUF model from a hub repo is fetched by byte range instead: the node's own tensors (its layers, and the
embedding / final norm / LM head its stage uses) out of each part, into the sparse files that hold the headers
(gguf/hub.py). Only sizes can be verified there: the LFS hash covers the whole file, which the node never holds.

Why not hf_hub_download for the weights: huggingface_hub 2.x downloads into a temporary file unique to the
process and deletes it when the download fails, so a node that is stopped mid-file starts that file over. Here
a partial file persists as blobs/<sha256>.part and the next attempt continues it with a Range request (through
huggingface_hub's own http_get, which also retries transient errors). The SHA-256 from the LFS metadata is
checked before the blob is moved into place, and snapshots/<commit>/<file> links to it as in the hub's cache.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import errno
import functools
import hashlib
import logging
import os
import shutil
import threading
from collections.abc import Iterator, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO, Callable

from filelock import FileLock
from huggingface_hub import constants, hf_hub_download, hf_hub_url
from huggingface_hub.file_download import http_get
from huggingface_hub.utils import build_hf_headers

from exo_like.errors import DownloadError, ExoLikeError, HubUnavailableError, InsufficientDiskError
from exo_like.models.checkpoint import INDEX_FILE, files_for_shard, local_tensor_name, weight_map
from exo_like.models.gguf.file import open_gguf
from exo_like.models.gguf.hub import fetch_ranges, gguf_folder, shard_ranges
from exo_like.models.hub.peer_files import PeerSource
from exo_like.models.hub.progress import DownloadProgress
from exo_like.models.hub.repo import (LIBRARY, RemoteFile, RepoManifest, blob_path, cache_only, endpoint, hub_errors,
                                      link_blob, offline, storage_folder)
from exo_like.models.hub.sparse_file import Range, present_ranges, subtract, total
from exo_like.models.shard import Shard

log = logging.getLogger(__name__)

WORKERS = 4  # files fetched at once: enough to fill a link, few enough to keep each file's progress visible
# http_get reads the body in pieces of huggingface_hub's DOWNLOAD_CHUNK_SIZE (10 MB) and writes each piece whole:
# smaller pieces make progress move on slow links and lose less of a partial file when a transfer is cut.
WRITE_CHUNK = 1 << 20
PARTIAL_SUFFIX = ".part"
HASH_CHUNK = 8 << 20


def shard_files(folder: Path, manifest: RepoManifest, shard: Shard, tied: bool) -> list[str]:
    """The weight files (names in the repo) that hold at least one tensor of the shard."""
    if (folder / INDEX_FILE).is_file():
        return sorted(files_for_shard(weight_map(folder), shard, tied))
    return sorted(manifest.files)  # a single-file checkpoint: every stage needs the one file


class ShardDownloader:
    """Fetches shards' weight files into the hub cache; one per node, shared by every plan it is given."""

    def __init__(self, cache_dir: Path, node_id: str, progress: DownloadProgress,
                 peers: Callable[[], list[PeerSource]] = list):
        self.cache_dir = cache_dir
        self.peers = peers  # the linked peers, asked for a file before the hub
        self.node_id = node_id
        self.progress = progress
        self._pool = ThreadPoolExecutor(WORKERS, thread_name_prefix="download")
        self._stopped = threading.Event()  # set at shutdown: transfers stop at their next chunk, resumable later
        constants.DOWNLOAD_CHUNK_SIZE = WRITE_CHUNK  # read by http_get at each call
        self._running: dict[str, concurrent.futures.Future[None]] = {}  # by file key (repo@commit/name)
        # The files each holder's latest shard needs (by owner: one per instance a node holds a part of). A transfer
        # of a file no holder wants any more (an earlier plan's) stops at its next chunk; its partial file stays, so
        # a later plan that needs it again resumes it.
        self._wanted: dict[str, frozenset[str]] = {}
        self._sizes: dict[str, tuple[str | None, int]] = {}  # by file key: (SHA-256, size), for sharing()

    async def ensure(self, manifest: RepoManifest, folder: Path, shard: Shard, tied: bool, owner: str = "",
                     members: Mapping[str, Shard] | None = None) -> None:
        """Return once every file the shard needs is in the snapshot folder; fetch only the missing ones. For a
        GGUF model `folder` is its first part, and the shard's byte ranges are what is fetched. `members`: every
        plan member's shard (this node's too), so that one member fetches each file from the hub and the others
        from it."""
        if manifest.gguf:
            return await self._ensure_ranges(manifest, folder, shard, tied, owner)
        names = shard_files(folder, manifest, shard, tied)
        missing = [name for name in names if not (folder / name).exists()]
        label = f"{manifest.repo_id} layers [{shard.start_layer}, {shard.end_layer})"
        if not missing:
            log.info("node %s: %s: all %d weight files are in the cache", self.node_id, label, len(names))
            return
        if offline() and not self.peers():
            why, remedy = cache_only()
            raise HubUnavailableError(
                f"{why}, no peer is linked, and {len(missing)} of the {len(names)} weight files of {label} are not in "
                f"the cache {self.cache_dir} ({', '.join(missing)}): {remedy} so the node can download them",
                code="model_not_cached")
        fetchers = chosen_fetchers(folder, manifest, tied, members or {self.node_id: shard})
        self._wanted[owner] = frozenset(_key(manifest, name) for name in names)
        self._sizes.update({_key(manifest, n): (manifest.files[n].sha256, manifest.files[n].size) for n in names})
        on_disk = {name: self._bytes_on_disk(manifest, folder, name) for name in names}
        absent = sum(manifest.files[n].size - on_disk[n] for n in missing)
        self._check_disk(label, absent)
        self.progress.start(label, {n: manifest.files[n].size for n in names}, on_disk)
        log.info("node %s: %s: downloading %d of %d weight files (%d bytes; fetched for the plan by this node: %s)",
                 self.node_id, label, len(missing), len(names), absent,
                 ", ".join(n for n in missing if fetchers.get(n, self.node_id) == self.node_id) or "none")
        await self._run_all(label, {_key(manifest, n): functools.partial(self._fetch, manifest, n, fetchers.get(n))
                                    for n in missing})

    async def _ensure_ranges(self, manifest: RepoManifest, first: Path, shard: Shard, tied: bool,
                             owner: str) -> None:
        """A GGUF model: the byte ranges of the shard's tensors in every part, into the parts' sparse files."""
        # In a thread: after the last download changed the file, its header is parsed again (seconds for a large
        # vocabulary).
        wanted = await asyncio.to_thread(self._gguf_ranges, manifest, first, shard, tied)
        missing = {name: subtract(ranges, present_ranges(part, manifest.files[name].size))
                   for name, (part, ranges) in wanted.items()}
        needed = {name: total(ranges) for name, (_, ranges) in wanted.items()}
        label = f"{manifest.repo_id} layers [{shard.start_layer}, {shard.end_layer})"
        absent = sum(total(spans) for spans in missing.values())
        if not absent:
            log.info("node %s: %s: all %d bytes of its tensors are in the cache", self.node_id, label,
                     sum(needed.values()))
            return
        if offline():
            why, remedy = cache_only()
            raise HubUnavailableError(
                f"{why} and {absent} bytes of the tensors of {label} are not in the cache {self.cache_dir}: "
                f"{remedy} so the node can download them", code="model_not_cached")
        # A key per part and set of ranges: a transfer of the same part for an earlier plan stops at its next chunk.
        keys = {name: f"{_key(manifest, name)}#{hash(tuple(ranges)):x}" for name, (_, ranges) in wanted.items()}
        self._wanted[owner] = frozenset(keys.values())
        self._check_disk(label, absent)
        self.progress.start(label, needed, {n: needed[n] - total(missing[n]) for n in wanted})
        log.info("node %s: %s: downloading %d bytes in %d ranges of %d GGUF part(s)", self.node_id, label, absent,
                 sum(len(spans) for spans in missing.values()), sum(1 for spans in missing.values() if spans))
        await self._run_all(label, {keys[name]: functools.partial(self._fetch_ranges, manifest, name, part, ranges,
                                                                  keys[name])
                                    for name, (part, ranges) in wanted.items() if missing[name]})

    def _gguf_ranges(self, manifest: RepoManifest, first: Path, shard: Shard, tied: bool
                     ) -> dict[str, tuple[Path, list[Range]]]:
        """Repo path of each part -> (its sparse file, the byte ranges of the shard's tensors in it)."""
        root = gguf_folder(self.cache_dir, manifest.repo_id, manifest.commit)
        spans = shard_ranges(open_gguf(first), lambda name: local_tensor_name(name, shard, tied) is not None)
        return {part.relative_to(root).as_posix(): (part, ranges) for part, ranges in spans.items()}

    async def _run_all(self, label: str, jobs: dict[str, Callable[[], None]]) -> None:
        """Run the transfers (by key), reporting the outcome to the progress tracker."""
        try:
            try:
                await asyncio.gather(*(asyncio.wrap_future(self._submit(key, job)) for key, job in jobs.items()))
            except DownloadStopped:
                if self._stopped.is_set():
                    raise
                # An earlier plan's transfer of a file stopped just as this plan asked for it: start it again (it
                # resumes from its partial file); transfers still running are joined, not repeated.
                await asyncio.gather(*(asyncio.wrap_future(self._submit(key, job)) for key, job in jobs.items()))
        except ExoLikeError as exc:
            self.progress.fail(exc.message)
            raise
        self.progress.finish()
        log.info("node %s: %s: download complete", self.node_id, label)

    def sharing(self, repo_id: str, commit: str, name: str) -> Sharing | None:
        """For a peer asking for a weight file this node does not hold whole: the transfer of it under way here (its
        partial file grows), or that one is queued, or None when this node is not fetching it."""
        key = f"{repo_id}@{commit}/{name}"
        if not self._is_wanted(key):
            return None
        running = self._running.get(key)
        if running is None or not running.running():
            return Sharing(None, 0, lambda: False) if running is None or not running.done() else None
        sha256, size = self._sizes.get(key, (None, 0))
        if sha256 is None:
            return None
        return Sharing(blob_path(self.cache_dir, repo_id, sha256, PARTIAL_SUFFIX), size, running.done)

    def forget(self, owner: str) -> None:
        """The owner holds nothing any more (its instance was unloaded): its files' transfers stop."""
        self._wanted.pop(owner, None)

    def _is_wanted(self, key: str) -> bool:
        return any(key in files for files in list(self._wanted.values()))

    def close(self) -> None:
        self._stopped.set()
        self._pool.shutdown(wait=False, cancel_futures=True)

    def _submit(self, key: str, job: Callable[[], None]) -> concurrent.futures.Future[None]:
        running = self._running.get(key)
        if running is None or running.done():
            running = self._pool.submit(job)
            self._running[key] = running
        return running

    def _fetch(self, manifest: RepoManifest, name: str, fetcher: str | None) -> None:
        """One file, in a download thread: from the member chosen to fetch it from the hub (waiting for it), else
        a peer that holds it, else the hub; every failure becomes an error that says what to do."""
        remote = manifest.files[name]
        if not self._is_wanted(_key(manifest, name)):  # queued for a plan that has changed since
            raise DownloadStopped(f"the plan changed and no longer needs {name}")
        peers = sorted(self.peers(), key=lambda peer: peer.node_id != fetcher)
        chosen = peers[0] if peers and peers[0].node_id == fetcher else None
        with self._transfer_errors(manifest, name):
            fetch_file(self.cache_dir, manifest.repo_id, manifest.commit, name, remote,
                       lambda count: self._received(_key(manifest, name), name, count), peers, chosen)
        self.progress.file_done(name)
        log.info("node %s: %s: %s fetched and verified (%d bytes)", self.node_id, manifest.repo_id, name, remote.size)

    def _fetch_ranges(self, manifest: RepoManifest, name: str, part: Path, ranges: list[Range], key: str) -> None:
        """The shard's byte ranges of one GGUF part, in a download thread."""
        if not self._is_wanted(key):
            raise DownloadStopped(f"the plan changed and no longer needs these ranges of {name}")
        with self._transfer_errors(manifest, name):
            fetch_ranges(manifest.repo_id, manifest.commit, name, manifest.files[name], part, ranges,
                         lambda count: self._received(key, name, count))
        self.progress.file_done(name)
        log.info("node %s: %s: %s: %d bytes of the shard's tensors fetched (sizes checked; a partial file has no "
                 "hash to check)", self.node_id, manifest.repo_id, name, total(ranges))

    @contextmanager
    def _transfer_errors(self, manifest: RepoManifest, name: str) -> Iterator[None]:
        """Every failure of a transfer becomes an error that says what to do."""
        try:
            with hub_errors(manifest.repo_id, self.cache_dir, name):
                yield
        except OSError as exc:
            if exc.errno == errno.ENOSPC:
                raise InsufficientDiskError(f"the disk of {self.cache_dir} filled up while downloading {name}: "
                                            f"free some space; the download resumes where it stopped",
                                            code="insufficient_disk") from None
            raise DownloadError(f"downloading {name} of {manifest.repo_id} failed ({exc}); the part already "
                                f"fetched is kept and the next attempt resumes it", code="download_failed") from None

    def _received(self, key: str, name: str, count: int) -> None:
        if self._stopped.is_set():
            raise DownloadStopped(f"the node is stopping: {name} resumes from here on the next start")
        if not self._is_wanted(key):
            raise DownloadStopped(f"the plan changed and no longer needs {name}")
        self.progress.add(name, count)

    def _bytes_on_disk(self, manifest: RepoManifest, folder: Path, name: str) -> int:
        remote = manifest.files[name]
        if (folder / name).exists():
            return remote.size
        if remote.sha256 is None:
            return 0
        part = blob_path(self.cache_dir, manifest.repo_id, remote.sha256, PARTIAL_SUFFIX)
        return part.stat().st_size if part.exists() else 0

    def _check_disk(self, label: str, needed: int) -> None:
        """Refuse before fetching anything when the cache's disk cannot hold the rest of the shard."""
        self.cache_dir.mkdir(parents=True, exist_ok=True)
        free = shutil.disk_usage(self.cache_dir).free
        if needed > free:
            raise InsufficientDiskError(
                f"not enough disk space for {label}: {needed} bytes to download into {self.cache_dir}, "
                f"{free} bytes free: free some space, or point --hub-cache (or HF_HUB_CACHE) at a bigger disk",
                code="insufficient_disk")


class DownloadStopped(Exception):
    """Raised inside a transfer to end it early (its partial file stays, to be resumed)."""


@dataclass(frozen=True)
class Sharing:
    """A weight file this node is fetching, as a peer may read it: its partial file (None: queued, not begun),
    its size, and whether the transfer has ended."""

    part: Path | None
    size: int
    finished: Callable[[], bool]


def chosen_fetchers(folder: Path, manifest: RepoManifest, tied: bool, members: Mapping[str, Shard]) -> dict[str, str]:
    """Which member fetches each weight file from the hub: the lowest node id among those whose shard needs it
    (every member computes the same from the plan); the others fetch it from that one."""
    fetchers: dict[str, str] = {}
    for node_id in sorted(members, reverse=True):
        for name in shard_files(folder, manifest, members[node_id], tied):
            fetchers[name] = node_id
    return fetchers


def fetch_file(cache_dir: Path, repo_id: str, commit: str, name: str, remote: RemoteFile,
               on_bytes: Callable[[int], None], peers: Sequence[PeerSource] = (),
               chosen: PeerSource | None = None) -> None:
    """Put one file of the repo at `commit` into the cache: resume its partial blob from the peer chosen to fetch
    it from the hub (waiting while it says the file is coming), else from a peer that holds it, else from the hub
    (unless offline); verify it, link it."""
    pointer = storage_folder(cache_dir, repo_id) / "snapshots" / commit / name
    if pointer.exists():
        return
    if remote.sha256 is None:
        # Stored in git, not LFS: no hash to resume against, and small; huggingface_hub fetches it whole.
        hf_hub_download(repo_id, name, revision=commit, cache_dir=cache_dir, endpoint=endpoint(), **LIBRARY)
        on_bytes(remote.size)
        return
    blob = blob_path(cache_dir, repo_id, remote.sha256)
    blob.parent.mkdir(parents=True, exist_ok=True)
    # Nodes sharing a cache (same home, or HF_HUB_CACHE) must not append to the same partial file at once.
    with FileLock(str(blob_path(cache_dir, repo_id, remote.sha256, ".exo-like.lock"))):
        if not (blob.is_file() and blob.stat().st_size == remote.size):
            _download_blob(repo_id, commit, name, remote, blob, on_bytes, peers, chosen)
        link_blob(blob, pointer)


def _download_blob(repo_id: str, commit: str, name: str, remote: RemoteFile, blob: Path,
                   on_bytes: Callable[[int], None], peers: Sequence[PeerSource], chosen: PeerSource | None) -> None:
    assert remote.sha256 is not None
    part = blob.with_name(blob.name + PARTIAL_SUFFIX)
    resume = part.stat().st_size if part.exists() else 0
    if resume > remote.size:
        part.unlink()  # not a prefix of this file
        resume = 0
    if resume:
        log.info("%s: resuming %s at byte %d of %d", repo_id, name, resume, remote.size)
    with open(part, "ab") as file:
        writer = HashingWriter(file, part, resume, on_bytes)
        if not any(peer.fetch(repo_id, commit, name, writer, remote.size, patient=peer is chosen) for peer in peers):
            if offline():
                why, remedy = cache_only()
                raise HubUnavailableError(f"{why} and no linked peer holds {name} of {repo_id}: {remedy} so the "
                                          f"node can download it", code="model_not_cached")
            http_get(hf_hub_url(repo_id, name, revision=commit, endpoint=endpoint()), writer,
                     resume_size=writer.size, headers=build_hf_headers(**LIBRARY), expected_size=remote.size,
                     displayed_filename=name)
    digest = writer.hexdigest()
    if digest != remote.sha256:
        part.unlink()  # corrupt: the next attempt starts this file over
        raise DownloadError(f"{name} of {repo_id} does not match its SHA-256 (expected {remote.sha256}, got {digest}); "
                            f"the bad copy was deleted: retry to download it again", code="download_corrupt")
    os.replace(part, blob)


class HashingWriter:
    """The file object handed to http_get: appends, reports new bytes, and hashes the whole file as it grows."""

    def __init__(self, file: BinaryIO, path: Path, existing: int, on_bytes: Callable[[int], None]):
        self._file = file
        self._on_bytes = on_bytes
        self._size = existing
        self._hash = hashlib.sha256()
        with open(path, "rb") as prefix:  # the resumed part is on disk already: hash it once, up front
            while self._hash_chunk(prefix.read(min(HASH_CHUNK, existing - prefix.tell()))):
                pass

    def write(self, chunk: bytes) -> int:
        self._on_bytes(len(chunk))  # first: it may stop the transfer, and then this chunk is not written
        self._hash.update(chunk)
        self._size += len(chunk)
        return self._file.write(chunk)

    @property
    def size(self) -> int:
        """Bytes of the file so far (resumed ones included)."""
        return self._size

    def tell(self) -> int:
        return self._file.tell()

    def seek(self, offset: int, whence: int = os.SEEK_SET) -> int:
        return self._file.seek(offset, whence)

    def truncate(self, size: int | None = None) -> int:
        """http_get starts over from byte 0 when a server ignores the Range header."""
        if (self._file.tell() if size is None else size) != 0:
            raise ValueError("a hashed download can only restart from byte 0")
        self._on_bytes(-self._size)
        self._size = 0
        self._hash = hashlib.sha256()
        return self._file.truncate(0)

    def flush(self) -> None:
        self._file.flush()

    def check(self) -> None:
        """Raise if the transfer should stop (the progress callback raises then)."""
        self._on_bytes(0)

    def hexdigest(self) -> str:
        return self._hash.hexdigest()

    def _hash_chunk(self, chunk: bytes) -> bool:
        self._hash.update(chunk)
        return bool(chunk)


def _key(manifest: RepoManifest, name: str) -> str:
    return f"{manifest.repo_id}@{manifest.commit}/{name}"
