"""The downloader in-process against the loopback hub: what a new plan fetches, corrupt partial files, a gated
repo with a token, and the disk check. (Whole nodes against the same hub are in test_download.py.)"""

from __future__ import annotations

import asyncio
import shutil
from pathlib import Path
from types import SimpleNamespace
from typing import Iterator

import pytest

from exo_like.errors import DownloadError, InsufficientDiskError, ModelAccessError
from exo_like.models.checkpoint import files_for_shard, weight_map
from exo_like.models.hub import download as download_module
from exo_like.models.hub.download import WRITE_CHUNK, ShardDownloader
from exo_like.models.hub.progress import DownloadProgress
from exo_like.models.hub.repo import storage_folder
from exo_like.models.shard import Shard
from exo_like.models.names.listing import list_models
from exo_like.models.names.name import parse_model_name
from exo_like.models.names.resolver import HubModel, fetch_hub_model
from tests.checkpoints import make_checkpoint
from tests.hub_server import TOKEN, HubServer

REPO, GATED, WIDE = "test-org/qwen5", "gated-org/qwen5", "test-org/wide"


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_checkpoint(tmp_path_factory.mktemp("ckpt") / "qwen5", "qwen2", n_layers=5, max_shard_size="100KB")


@pytest.fixture(scope="module")
def wide(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """About one 4 MB file per layer: several write chunks each, so a transfer can stop half way."""
    return make_checkpoint(tmp_path_factory.mktemp("ckpt") / "wide", "llama", n_layers=4, hidden_size=256,
                           intermediate_size=1024, max_shard_size="4MB")


@pytest.fixture(scope="module")
def hub(checkpoint: Path, wide: Path) -> Iterator[HubServer]:
    server = HubServer()
    server.add_repo(REPO, checkpoint)
    server.add_repo(GATED, checkpoint, gated=True)
    server.add_repo(WIDE, wide)
    server.start()
    yield server
    server.stop()


@pytest.fixture
def online(hub: HubServer, monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Path:
    """HF_ENDPOINT at the loopback hub, no token; returns a fresh cache folder."""
    monkeypatch.setenv("HF_ENDPOINT", hub.endpoint)
    monkeypatch.delenv("HF_TOKEN", raising=False)
    return tmp_path / "cache"


def prepare(repo: str, cache: Path) -> HubModel:
    return fetch_hub_model(parse_model_name(repo, cache.parent), cache)


def needed(checkpoint: Path, shard: Shard) -> set[str]:
    return files_for_shard(weight_map(checkpoint), shard, tied_embeddings=True)


async def test_a_new_plan_fetches_only_the_files_it_adds(hub: HubServer, checkpoint: Path, online: Path) -> None:
    model = prepare(REPO, online)
    downloader = ShardDownloader(online, "n", DownloadProgress())
    first, second = Shard(REPO, 0, 2, 5), Shard(REPO, 0, 4, 5)
    assert needed(checkpoint, first) < needed(checkpoint, second)
    seen = len(hub.requests())
    await downloader.ensure(model.manifest, model.folder, first, tied=True)
    assert {r.file for r in hub.weight_downloads(since=seen)} == needed(checkpoint, first)
    listed = {m["id"]: m for m in list_models(online.parent, online, [], 0)}[REPO]
    assert (listed["state"], listed["weight_files_present"]) == ("partial", len(needed(checkpoint, first)))
    seen = len(hub.requests())
    await downloader.ensure(model.manifest, model.folder, second, tied=True)
    fetched = [r.file for r in hub.weight_downloads(since=seen)]
    assert sorted(fetched) == sorted(needed(checkpoint, second) - needed(checkpoint, first))
    seen = len(hub.requests())
    await downloader.ensure(model.manifest, model.folder, first, tied=True)  # back to the smaller range: all here
    assert hub.weight_downloads(since=seen) == []
    await downloader.ensure(model.manifest, model.folder, Shard(REPO, 0, 5, 5), tied=True)
    assert {m["id"]: m for m in list_models(online.parent, online, [], 0)}[REPO]["state"] == "downloaded"
    downloader.close()


async def test_a_new_plan_stops_transfers_it_does_not_need_and_a_later_one_resumes_them(
        hub: HubServer, wide: Path, online: Path) -> None:
    model = prepare(WIDE, online)
    whole, first = Shard(WIDE, 0, 4, 4), Shard(WIDE, 0, 1, 4)
    dropped = sorted(files_for_shard(weight_map(wide), whole, False) - files_for_shard(weight_map(wide), first, False))
    assert dropped and all(model.manifest.files[name].size > WRITE_CHUNK for name in dropped)
    downloader = ShardDownloader(online, "n", DownloadProgress())
    hub.throttle = 2 * WRITE_CHUNK  # bytes per second per transfer: each file takes a couple of seconds
    try:
        everything = asyncio.ensure_future(downloader.ensure(model.manifest, model.folder, whole, tied=False))
        assert await wait_until(lambda: (status := downloader.progress.status()) is not None
                                and status.done_bytes >= 2 * WRITE_CHUNK)
        everything.cancel()  # what the cluster does when the plan changes
        await downloader.ensure(model.manifest, model.folder, first, tied=False)
        parts = {name: _part(online, model, name) for name in dropped}
        assert await wait_until(lambda: all(downloader_idle(downloader, model, name) for name in dropped))
        sizes = {name: part.stat().st_size if part.exists() else 0 for name, part in parts.items()}
        assert all(sizes[name] < model.manifest.files[name].size for name in dropped), sizes  # stopped early
        assert not any((model.folder / name).exists() for name in dropped)
    except BaseException:
        downloader.close()  # stop the transfers this test started
        raise
    finally:
        hub.throttle = None
    seen = len(hub.requests())
    await downloader.ensure(model.manifest, model.folder, whole, tied=False)
    resumed = {r.file: r.range_start for r in hub.weight_downloads(since=seen)}
    assert resumed == {name: sizes[name] or None for name in dropped}  # each from where it stopped
    assert all((model.folder / name).read_bytes() == (wide / name).read_bytes() for name in dropped)
    downloader.close()


def _part(cache: Path, model: HubModel, name: str) -> Path:
    return storage_folder(cache, model.repo_id) / "blobs" / f"{model.manifest.files[name].sha256}.part"


def downloader_idle(downloader: ShardDownloader, model: HubModel, name: str) -> bool:
    running = downloader._running.get(f"{model.repo_id}@{model.manifest.commit}/{name}")
    return running is None or running.done()


async def wait_until(predicate, timeout: float = 20.0) -> bool:  # type: ignore[no-untyped-def]
    deadline = asyncio.get_running_loop().time() + timeout
    while not predicate():
        if asyncio.get_running_loop().time() > deadline:
            return False
        await asyncio.sleep(0.05)
    return True


async def test_a_corrupt_partial_file_is_caught_by_its_hash_deleted_and_fetched_again(
        hub: HubServer, checkpoint: Path, online: Path) -> None:
    model = prepare(REPO, online)
    shard = Shard(REPO, 4, 5, 5)  # the last stage: its layer, the final norm and the (tied) embedding as head
    name = sorted(needed(checkpoint, shard))[0]
    remote = model.manifest.files[name]
    part = storage_folder(online, REPO) / "blobs" / f"{remote.sha256}.part"
    part.parent.mkdir(parents=True, exist_ok=True)
    part.write_bytes(b"\xff" * (remote.size // 2))  # right length for a prefix, wrong bytes
    downloader = ShardDownloader(online, "n", DownloadProgress())
    seen = len(hub.requests())
    with pytest.raises(DownloadError) as failure:
        await downloader.ensure(model.manifest, model.folder, shard, tied=True)
    assert failure.value.code == "download_corrupt" and name in failure.value.message
    assert not part.exists() and not (model.folder / name).exists()
    resumed = [r for r in hub.weight_downloads(since=seen) if r.file == name]
    assert [r.range_start for r in resumed] == [remote.size // 2]  # it did resume the partial file
    assert downloader.progress.status().state == "failed"
    await downloader.ensure(model.manifest, model.folder, shard, tied=True)
    assert (model.folder / name).read_bytes() == (checkpoint / name).read_bytes()
    assert downloader.progress.status().state == "complete"
    downloader.close()


async def test_a_gated_repo_needs_hf_token(hub: HubServer, checkpoint: Path, online: Path,
                                           monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(ModelAccessError) as refused:
        prepare(GATED, online)
    assert refused.value.code == "gated_model" and "HF_TOKEN" in refused.value.message
    monkeypatch.setenv("HF_TOKEN", TOKEN)
    model = prepare(GATED, online)
    downloader = ShardDownloader(online, "n", DownloadProgress())
    await downloader.ensure(model.manifest, model.folder, Shard(GATED, 0, 5, 5), tied=True)
    assert {p.name for p in model.folder.glob("*.safetensors")} == needed(checkpoint, Shard(GATED, 0, 5, 5))
    downloader.close()


async def test_not_enough_disk_is_refused_before_any_byte_is_fetched(hub: HubServer, online: Path,
                                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    model = prepare(REPO, online)
    free = 1000
    monkeypatch.setattr(download_module.shutil, "disk_usage",
                        lambda path: SimpleNamespace(total=free, used=0, free=free))
    downloader = ShardDownloader(online, "n", DownloadProgress())
    seen = len(hub.requests())
    with pytest.raises(InsufficientDiskError) as refused:
        await downloader.ensure(model.manifest, model.folder, Shard(REPO, 0, 5, 5), tied=True)
    message = refused.value.message
    assert f"{model.manifest.total_bytes} bytes to download" in message and f"{free} bytes free" in message
    assert "--hub-cache" in message and hub.weight_downloads(since=seen) == []
    downloader.close()


def test_the_cache_is_the_hubs_layout_and_the_layer_sizes_match_the_local_headers(checkpoint: Path,
                                                                                 online: Path) -> None:
    from exo_like.models.footprint import model_footprint

    model = prepare(REPO, online)
    assert model.folder == storage_folder(online, REPO) / "snapshots" / model.manifest.commit
    assert (storage_folder(online, REPO) / "refs" / "main").read_text() == model.manifest.commit
    assert model.manifest.footprint == model_footprint(checkpoint, 5, True)  # planned before any weight file
    assert not list(model.folder.glob("*.safetensors"))
    shutil.rmtree(online)


async def test_two_holders_download_at_once_without_stopping_each_other(hub: HubServer, wide: Path,
                                                                        online: Path) -> None:
    """Two instances loading on one node at once (each holder its own owner): neither's transfers count as an
    earlier plan's; forgotten, an owner's transfers stop."""
    model = prepare(WIDE, online)
    first, last = Shard(WIDE, 0, 1, 4), Shard(WIDE, 3, 4, 4)
    downloader = ShardDownloader(online, "n", DownloadProgress())
    hub.throttle = 4 * WRITE_CHUNK  # long enough that the two overlap
    try:
        await asyncio.gather(downloader.ensure(model.manifest, model.folder, first, False, owner="x"),
                             downloader.ensure(model.manifest, model.folder, last, False, owner="y"))
    finally:
        hub.throttle = None
        downloader.close()
    needed = files_for_shard(weight_map(wide), first, False) | files_for_shard(weight_map(wide), last, False)
    assert all((model.folder / name).read_bytes() == (wide / name).read_bytes() for name in needed)
