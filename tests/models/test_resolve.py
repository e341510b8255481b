"""A model name is read once and resolved once.

Every form of name parses to its parts (no network). Against the loopback hub (tests/hub_server.py): the first
resolution of a hub name reads the hub; resolving it again, by another spelling (a catalog name's case, a tag's
case, the pinned key), and everything downstream (planning's describe, the speed probe's files, GET /v1/models
and /v1/models/{id}, a request's model) answers from the cache and sends the hub nothing.
"""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Iterator

import pytest

pytest.importorskip("gguf", reason="gguf is not installed")

from exo_like.errors import ModelNotFoundError  # noqa: E402
from exo_like.models.names.catalog import PACKAGED, lookup  # noqa: E402
from exo_like.models.names.name import ModelName, parse_model_name  # noqa: E402
from exo_like.models.names.model_registry import ModelRegistry  # noqa: E402
from tests.checkpoints import make_checkpoint  # noqa: E402
from tests.gguf_checkpoints import write_gguf  # noqa: E402
from tests.hub_server import HubServer  # noqa: E402

REPO, GGUF_REPO = "test-org/tiny", "test-org/tiny-GGUF"
CATALOG_NAME = "qwen2.5-0.5b"
CATALOG_REPO = "Qwen/Qwen2.5-0.5B-Instruct"  # the catalog entry's first repo (served by the loopback hub here)


def parts(name: ModelName) -> tuple[object, ...]:
    return name.kind, name.path, name.repos, name.revision, name.tag, name.canonical


def test_each_form_of_name_parses_to_its_parts(tmp_path: Path) -> None:
    folder = tmp_path / "models" / "mine"
    folder.mkdir(parents=True)
    (folder / "config.json").write_text("{}")
    gguf = tmp_path / "models" / "m-Q4_0.gguf"
    gguf.write_bytes(b"GGUF")
    local, file = ("local", folder.resolve(), (), None, None, str(folder.resolve())), str(gguf.absolute())
    commit = "0123456789abcdef0123456789abcdef01234567"
    expected = {
        "demo": ("demo", None, (), None, None, "demo"),
        "mine": local,
        str(folder): local,
        "m-Q4_0.gguf": ("local", gguf.absolute(), (), None, None, file),
        str(gguf): ("local", gguf.absolute(), (), None, None, file),
        "Qwen2.5-0.5B": ("hub", None, lookup(CATALOG_NAME).repos, None, None, CATALOG_NAME),  # any case
        CATALOG_REPO: ("hub", None, (CATALOG_REPO,), None, None, CATALOG_REPO),
        "org/name": ("hub", None, ("org/name",), None, None, "org/name"),
        "org/name@refs/pr/1": ("hub", None, ("org/name",), "refs/pr/1", None, "org/name@refs/pr/1"),
        "org/name-GGUF:q4_k_m": ("hub", None, ("org/name-GGUF",), None, "Q4_K_M", "org/name-GGUF:Q4_K_M"),
        f"org/name-GGUF@{commit}:q8_0": ("hub", None, ("org/name-GGUF",), commit, "Q8_0",
                                         f"org/name-GGUF@{commit}:Q8_0"),
    }
    for text, wanted in expected.items():
        assert parts(parse_model_name(text, tmp_path)) == wanted, text
    assert parse_model_name(CATALOG_REPO, tmp_path).catalog is lookup(CATALOG_NAME)  # the repo's catalog entry
    with pytest.raises(ModelNotFoundError, match="not found"):  # too long for a path: no local model, not an OSError
        parse_model_name("x" * 300, tmp_path)
    packaged = PACKAGED["smollm2-135m"].path()
    if packaged is None:  # the package is not installed: the name says how to get it
        with pytest.raises(ModelNotFoundError, match="pip install"):
            parse_model_name("SmolLM2-135M", tmp_path)
    else:
        assert parts(parse_model_name("SmolLM2-135M", tmp_path)) == ("local", packaged.absolute(), (), None, None,
                                                                      str(packaged.absolute()))


@pytest.fixture(scope="module")
def hub(tmp_path_factory: pytest.TempPathFactory) -> Iterator[HubServer]:
    folder = make_checkpoint(tmp_path_factory.mktemp("hf") / "tiny", "llama", n_layers=2, hidden_size=256,
                             intermediate_size=512, rope_scaling=None)
    gguf = tmp_path_factory.mktemp("gguf")
    write_gguf(folder, gguf / "tiny-Q8_0.gguf", "Q8_0")
    server = HubServer()
    for repo_id, files in ((REPO, folder), (GGUF_REPO, gguf), (CATALOG_REPO, folder)):
        server.add_repo(repo_id, files)
    server.start()
    yield server
    server.stop()


def spellings(hub: HubServer) -> list[tuple[str, list[str]]]:
    """(the name a model is first resolved by, other names of the same model)."""
    gguf_commit = hub.repos[GGUF_REPO].commit
    return [(REPO, [REPO, f"{REPO}@{hub.repos[REPO].commit}"]),
            (f"{GGUF_REPO}:q8_0", [f"{GGUF_REPO}:Q8_0", f"{GGUF_REPO}@{gguf_commit}:q8_0"]),
            (CATALOG_NAME, ["Qwen2.5-0.5B", "QWEN2.5-0.5B", CATALOG_REPO])]


def test_a_name_is_resolved_once_and_nothing_downstream_asks_the_hub_again(hub: HubServer, tmp_path: Path,
                                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HF_ENDPOINT", hub.endpoint)
    monkeypatch.delenv("HF_TOKEN", raising=False)
    registry = ModelRegistry(tmp_path / "home", tmp_path / "cache", "n0", lambda _: None)
    for first, others in spellings(hub):
        seen = len(hub.requests())
        model = registry.resolve(first)
        assert hub.requests(since=seen), f"{first}: the first resolution reads the hub"
        seen = len(hub.requests())
        for name in [first, *others, model.key, model.model_id]:
            assert registry.resolve(name).key == model.key, name
            assert registry.known(name).key == model.key, name
            assert asyncio.run(registry.prepare(name)).key == model.key, name  # a request's model
        description = registry.describe(model.key)  # planning
        assert (description.n_layers, description.footprint) == (2, model.manifest.footprint)
        assert registry.files(model.key) == (model.path, model.args)  # the speed probe
        assert registry.listing([(model, "serving")], 0)[0]["id"] == model.model_id  # GET /v1/models
        assert registry.entry(model.key, [(model, "serving")], 0)["id"] == model.model_id  # GET /v1/models/{id}
        assert hub.requests(since=seen) == [], f"{first}: asked the hub again"
        assert registry.entry(model.model_id, [(model, "serving")], 0)["id"] == model.model_id
