"""`--api-key` (exo_like/api/routes.py): without the key every API route and the dashboard's data answer 401 in the
shape of their dialect; with it (as a Bearer token, Anthropic's x-api-key, or the dashboard's cookie) the official
clients work; /health, the peer link and the dashboard's page stay open. In-process: one node, its app guarded."""

from __future__ import annotations

import asyncio
from pathlib import Path
from urllib.parse import quote

import pytest
from aiohttp.test_utils import TestClient, TestServer

from exo_like.api.routes import create_app
from exo_like.node import Node, NodeOptions
from tests.api_server import checkpoint  # noqa: F401  (fixture)

KEY = "s3cret;key with spaces"  # a cookie cannot hold ";" or " ": the page stores it URI-encoded

OPENAI = ("error", "code", "invalid_api_key")
GUARDED = [  # (method, path, JSON body, where the error's kind is in the body)
    ("POST", "/v1/chat/completions", {"model": "m", "messages": [{"role": "user", "content": "Hi"}]}, OPENAI),
    ("POST", "/v1/completions", {"model": "m", "prompt": "Hi"}, OPENAI),
    ("POST", "/v1/responses", {"model": "m", "input": "Hi"}, OPENAI),
    ("GET", "/v1/models", None, OPENAI),
    ("GET", "/v1/cluster", None, OPENAI),
    ("GET", "/v1/events", None, OPENAI),
    ("GET", "/metrics", None, OPENAI),
    ("POST", "/v1/messages", {"model": "m", "max_tokens": 4, "messages": [{"role": "user", "content": "Hi"}]},
     ("error", "type", "authentication_error")),
    ("POST", "/api/chat", {"model": "m", "messages": [{"role": "user", "content": "Hi"}]}, None),
    ("GET", "/api/tags", None, None),
]


@pytest.fixture
async def guarded(checkpoint: Path, tmp_path: Path):  # noqa: F811
    node = Node(NodeOptions(home=tmp_path, engine="torch", dtype="float32", mdns=False, model=str(checkpoint)))
    async with TestClient(TestServer(create_app(node, KEY))) as http:
        await node.start("127.0.0.1", http.port)
        yield node, http
    await node.close()


REFUSED = [({}, "requires an API key"), ({"Authorization": "Bearer wrong"}, "incorrect API key"),
           ({"x-api-key": "wrong"}, "incorrect API key"), ({"Authorization": f"Basic {KEY}"}, "requires an API key")]


async def test_every_api_route_refuses_a_request_without_the_key_in_its_dialects_shape(guarded) -> None:
    _, http = guarded
    for sent, said in REFUSED:
        for method, path, body, kind in GUARDED:
            response = await http.request(method, path, json=body, headers=sent)
            assert response.status == 401, (path, sent, await response.text())
            error = await response.json()
            if kind is None:  # Ollama's shape: {"error": "message"}
                assert set(error) == {"error"} and "API key" in error["error"], path
            else:
                outer, field, value = kind
                assert error[outer][field] == value, (path, error)
            assert said in str(error), (path, sent, error)


async def test_the_key_opens_every_route_as_a_header_or_the_dashboards_cookie(guarded) -> None:
    _, http = guarded
    for sent, cookies in (({"Authorization": f"Bearer {KEY}"}, None), ({"x-api-key": KEY}, None),
                          ({}, {"exo_like_api_key": quote(KEY)})):
        http.session.cookie_jar.clear()
        if cookies:
            http.session.cookie_jar.update_cookies(cookies)
        assert (await http.get("/v1/models", headers=sent)).status == 200
        assert (await http.get("/api/tags", headers=sent)).status == 200
        assert (await http.get("/metrics", headers=sent)).status == 200
    http.session.cookie_jar.clear()
    for path in ("/health", "/dashboard/app.js"):
        assert (await http.get(path)).status == 200, path
    page = await http.get("/", headers={"Accept": "text/html"})
    assert page.status == 200 and 'id="key-form"' in await page.text()


async def test_the_official_clients_work_with_the_key_and_are_told_without_it(guarded, checkpoint) -> None:  # noqa: F811
    import anthropic
    import ollama
    import openai

    node, http = guarded
    await node.instances.oldest().wait_ready(60)
    base = f"http://127.0.0.1:{http.port}"
    ask = [{"role": "user", "content": "Hi"}]

    def clients() -> tuple[str, str, str]:
        chat = openai.OpenAI(base_url=base + "/v1", api_key=KEY, max_retries=0).chat.completions.create(
            model=str(checkpoint), messages=ask, max_tokens=3, temperature=0)
        with pytest.raises(openai.AuthenticationError):
            openai.OpenAI(base_url=base + "/v1", api_key="wrong", max_retries=0).models.list()
        message = anthropic.Anthropic(base_url=base, api_key=KEY, max_retries=0).messages.create(
            model=str(checkpoint), max_tokens=3, messages=ask)
        with pytest.raises(anthropic.AuthenticationError):
            anthropic.Anthropic(base_url=base, api_key="wrong", max_retries=0).messages.create(
                model=str(checkpoint), max_tokens=3, messages=ask)
        local = ollama.Client(host=base, headers={"Authorization": f"Bearer {KEY}"})
        generated = local.generate(model=str(checkpoint), prompt="Hi", options={"num_predict": 3})
        with pytest.raises(ollama.ResponseError) as refused:
            ollama.Client(host=base).list()
        assert refused.value.status_code == 401
        return chat.choices[0].message.content, message.content[0].text, generated.response

    answers = await asyncio.to_thread(clients)
    assert all(answers), answers
