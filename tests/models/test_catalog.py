"""The model catalog: shapes that reproduce the published parameter counts, and how model names are classified."""

from __future__ import annotations

from pathlib import Path

import pytest

from exo_like.errors import ModelNotFoundError
from exo_like.models.names.catalog import CATALOG, entry_for_repo, lookup
from exo_like.models.names.listing import list_models
from exo_like.models.names.name import is_repo_id, parse_model_name

# Exact parameter counts of the published checkpoints (their safetensors metadata), which the shapes must give.
PUBLISHED_PARAMETERS = {
    "llama-3.2-1b": 1_235_814_400,
    "llama-3.1-8b": 8_030_261_248,
    "llama-3.1-70b": 70_553_706_496,
    "qwen2.5-0.5b": 494_032_768,
    "qwen2.5-3b": 3_085_938_688,
    "qwen2.5-7b": 7_615_616_512,
    "mistral-7b": 7_248_023_552,
}
LAYERS = {"llama-3.2-1b": 16, "llama-3.2-3b": 28, "llama-3.1-8b": 32, "llama-3.1-70b": 80, "llama-3.3-70b": 80,
          "qwen2.5-0.5b": 24, "qwen2.5-1.5b": 28, "qwen2.5-3b": 36, "qwen2.5-7b": 28, "qwen2.5-14b": 48,
          "qwen2.5-32b": 64, "qwen2.5-72b": 80, "qwen3-0.6b": 28, "qwen3-1.7b": 28, "qwen3-4b": 36, "qwen3-8b": 36,
          "qwen3-14b": 40, "qwen3-32b": 64, "mistral-7b": 32}


@pytest.mark.parametrize("name, parameters", sorted(PUBLISHED_PARAMETERS.items()))
def test_shapes_give_the_published_parameter_count(name: str, parameters: int) -> None:
    assert CATALOG[name].parameters == parameters
    assert CATALOG[name].size_bytes == 2 * parameters  # bf16, as published


def test_the_catalog_has_the_issues_models_with_their_layer_counts() -> None:
    assert {name: entry.n_layers for name, entry in CATALOG.items()} == LAYERS


def test_every_entry_names_valid_repos_publisher_first_and_an_mlx_variant() -> None:
    for entry in CATALOG.values():
        assert all(is_repo_id(repo) for repo in entry.repos), entry.repos
        assert entry.repos[-1].startswith("mlx-community/") and entry.repos[-1].endswith("-4bit")
        assert entry.repos[0].split("/")[0] in ("meta-llama", "Qwen", "mistralai")
        assert all(entry_for_repo(repo) is entry for repo in entry.repos)


def test_v1_models_lists_what_home_models_holds_under_names_that_parse_as_local(tmp_path: Path) -> None:
    models = tmp_path / "models"
    for folder in ("hf", "one-gguf", "two-ggufs", "empty"):
        (models / folder).mkdir(parents=True)
    (models / "hf" / "config.json").write_text("{}")
    for name in ("a.gguf", "b-00001-of-00002.gguf", "b-00002-of-00002.gguf", "one-gguf/m.gguf", "two-ggufs/x.gguf",
                 "two-ggufs/y.gguf", "notes.txt"):
        (models / name).write_bytes(b"GGUF")
    listed = [m["id"] for m in list_models(tmp_path, tmp_path / "hub", [], 0) if m["source"] == "local"]
    assert listed == ["a.gguf", "b-00001-of-00002.gguf", "hf", "one-gguf"]
    assert all(parse_model_name(name, tmp_path).kind == "local" for name in listed)


def test_names_are_classified_without_the_network(tmp_path: Path) -> None:
    (tmp_path / "models" / "mine").mkdir(parents=True)
    (tmp_path / "models" / "mine" / "config.json").write_text("{}")
    assert parse_model_name("demo", tmp_path).kind == "demo"
    assert parse_model_name("mine", tmp_path).path == (tmp_path / "models" / "mine").resolve()
    assert parse_model_name(str(tmp_path / "models" / "mine"), tmp_path).kind == "local"
    qwen = parse_model_name("Qwen2.5-7B", tmp_path)  # catalog names ignore case
    assert (qwen.kind, qwen.repos[0], qwen.catalog) == ("hub", "Qwen/Qwen2.5-7B-Instruct", lookup("qwen2.5-7b"))
    repo = parse_model_name("someone/some-model_v1.5", tmp_path)
    assert (repo.kind, repo.repos, repo.catalog, repo.revision) == ("hub", ("someone/some-model_v1.5",), None, None)
    commit = "0123456789abcdef0123456789abcdef01234567"
    for revision in (commit, "v1.0", "refs/pr/1"):
        pinned = parse_model_name(f"Qwen/Qwen2.5-7B-Instruct@{revision}", tmp_path)
        assert (pinned.kind, pinned.repos, pinned.revision) == ("hub", ("Qwen/Qwen2.5-7B-Instruct",), revision)
        assert pinned.catalog is lookup("qwen2.5-7b")
    for bad in ("not a model", "/no/such/folder", "a/b/c", "org--x/y", "../x", "org/name@", "org/name@a b",
                "org/name@../x", "org/name@-x", "qwen2.5-7b@main", "org/name@x@y"):
        with pytest.raises(ModelNotFoundError):
            parse_model_name(bad, tmp_path)
