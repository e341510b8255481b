"""The dashboard in a real browser (Debian's headless Chromium, driven by Playwright) against real nodes.

Three nodes on loopback (6, 3 and 1 GiB over a 7-layer checkpoint), the page opened on them: it must show what
/v1/cluster says, follow a node's death without a reload, chat with the same greedy answer as the API, stop a
request everywhere, look the same from every node, and come back by itself when its node restarts. A plan with a
tensor-parallel group is drawn from the picture of an in-process cluster, served by the dashboard's own routes
(no nodes: a group needs worker processes, and what is checked is the drawing). Starting nodes is most of what
these cost: the three nodes serve every test that needs them, the one that kills a node last.
Screenshots go to artifacts/; any console error fails the test that caused it.
"""

from __future__ import annotations

import asyncio
import json
import math
import re
import signal
import threading
from collections.abc import Callable, Iterator
from decimal import ROUND_HALF_UP, Decimal
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
from aiohttp import web

from dashboard import add_routes, page
from tests.api.test_tools_openai import WEATHER
from tests.api_server import NodeProcess, start_node, stop_nodes, tools_checkpoint, tools_node, wait_for  # noqa: F401
from tests.checkpoints import make_checkpoint
from tests.cluster_harness import BY_MEMORY, cluster_of, free_ports, start_cluster, wait_until_ready
from tests.dashboard.test_dashboard_data import picture_of, tensor_parallel_cluster

CHROMIUM = Path("/usr/bin/chromium")
pytestmark = [pytest.mark.browser,
              pytest.mark.skipif(not CHROMIUM.exists(), reason="needs Debian's chromium at /usr/bin/chromium "
                                 "(apt-get install chromium; .ci/run installs it)")]

ARTIFACTS = Path(__file__).resolve().parents[2] / "artifacts"
BROWSER_ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                "--disable-background-networking", "--disable-component-update", "--disable-sync"]
DESKTOP = {"width": 1280, "height": 800}
PHONE = {"width": 390, "height": 844}
PROMPT = "What is the capital of France?"
MAX_TOKENS = 24


# -- what the page should say, formatted as the page formats it -------------------------------------------

def format_bytes(count: int) -> str:
    value, unit = float(count), 0
    units = ["B", "KiB", "MiB", "GiB", "TiB"]
    while value >= 1024 and unit < len(units) - 1:
        value, unit = value / 1024, unit + 1
    # JavaScript's toFixed rounds an exact half up; Python's format would round it to even.
    rounded = Decimal(value).quantize(Decimal("0.1"), rounding=ROUND_HALF_UP)
    return f"{count} B" if unit == 0 else f"{rounded} {units[unit]}"


def format_layers(start: int, end: int) -> str:
    return f"layer {start}" if end - start == 1 else f"layers {start}–{end - 1}"


# -- fixtures -----------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def seven_layers(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_checkpoint(tmp_path_factory.mktemp("ckpt") / "llama7", "llama", n_layers=7, max_shard_size="200KB")


@pytest.fixture(scope="module")
def three_nodes(seven_layers: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[list[NodeProcess]]:
    """Placed by memory, so every node holds layers (4, 2 and 1): the split follows from the memories set here.
    By measured speed one fast node may rightly take all seven (a hop costs more than a tiny layer). An hour's
    --peer-timeout, so a loss shown at all was seen from the closed connection (the last test using these nodes
    kills one)."""
    nodes = start_cluster(tmp_path_factory.mktemp("dashboard"), str(seven_layers), [6, 3, 1],
                          extra=("--placement", "memory", "--peer-timeout", "3600"))
    wait_until_ready(nodes, members=3)
    yield nodes
    stop_nodes(nodes)


@pytest.fixture
def speed_placed_nodes(seven_layers: Path, tmp_path: Path) -> Iterator[list[NodeProcess]]:
    """Nodes placed by their measured speed (the default): two of them, as what the test checks is per node (each
    node's speed, each holder's share, each node left out) and a node fewer is a process start less."""
    nodes = start_cluster(tmp_path, str(seven_layers), [6, 3])
    try:
        wait_until_ready(nodes, members=2)
        yield nodes
    finally:
        stop_nodes(nodes)


@pytest.fixture(scope="module")
def browser(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    from playwright.sync_api import sync_playwright

    with sync_playwright() as playwright:
        context = playwright.chromium.launch_persistent_context(
            str(tmp_path_factory.mktemp("chromium-profile")), executable_path=str(CHROMIUM), headless=True,
            args=BROWSER_ARGS, viewport=DESKTOP)
        yield context
        context.close()


class Dashboard:
    """One open page on one node, and every error its console reported."""

    def __init__(self, browser: Any, node: NodeProcess):
        self.page = browser.new_page()
        self.page.set_viewport_size(DESKTOP)
        self.errors: list[str] = []
        self.expected_errors: list[re.Pattern[str]] = []
        self.page.on("console", lambda message: message.type == "error" and self.errors.append(message.text))
        self.page.on("pageerror", lambda error: self.errors.append(f"uncaught: {error}"))
        self.page.goto(node.base_url + "/")
        self.page.wait_for_selector("#connection[data-state=live]", timeout=10_000)

    def cards(self) -> list[dict[str, Any]]:
        """The node cards, top to bottom."""
        return self.page.eval_on_selector_all("#nodes .node", """cards => cards.map(card => ({
            id: card.dataset.nodeId, status: card.dataset.status,
            start: card.dataset.start === undefined ? null : Number(card.dataset.start),
            end: card.dataset.end === undefined ? null : Number(card.dataset.end),
            name: card.querySelector('.node-name').textContent, you: card.querySelector('.you') !== null,
            text: card.textContent }))""")

    def tile(self, key: str) -> str:
        return self.page.inner_text(f'[data-tile="{key}"]')

    def wait_for(self, script: str, arg: Any = None, timeout: float = 5.0) -> None:
        self.page.wait_for_function(script, arg=arg, timeout=timeout * 1000)

    def screenshot(self, name: str, viewport: dict[str, int], full_page: bool = False) -> Path:
        self.page.set_viewport_size(viewport)
        ARTIFACTS.mkdir(exist_ok=True)
        path = ARTIFACTS / name
        self.page.screenshot(path=str(path), full_page=full_page)
        # Readable means no sideways scrolling at this width.
        assert self.page.evaluate("document.documentElement.scrollWidth") <= viewport["width"], name
        return path

    def unexpected_errors(self) -> list[str]:
        return [e for e in self.errors if not any(p.search(e) for p in self.expected_errors)]


@pytest.fixture
def open_page(browser: Any) -> Iterator[Callable[[NodeProcess], Dashboard]]:
    pages: list[Dashboard] = []

    def opener(node: NodeProcess) -> Dashboard:
        pages.append(Dashboard(browser, node))
        return pages[-1]

    yield opener
    for dashboard in pages:
        dashboard.page.close()
    assert [e for d in pages for e in d.unexpected_errors()] == [], "the browser console reported errors"


def wait_for_ready_cards(dashboard: Dashboard, count: int) -> None:
    dashboard.wait_for("n => { const cards = document.querySelectorAll('#nodes .node');"
                       " return cards.length === n && [...cards].every(c => c.dataset.status === 'ready'); }",
                       count, timeout=10)


def greedy_chat(node: NodeProcess, model: str, content: str, max_tokens: int) -> dict[str, Any]:
    body = json.dumps({"model": model, "messages": [{"role": "user", "content": content}],
                       "max_tokens": max_tokens, "temperature": 0}).encode()
    status, _, raw = node.request("POST", "/v1/chat/completions", body, {"Content-Type": "application/json"})
    assert status == 200, raw
    return json.loads(raw)


def open_settings(dashboard: Dashboard, temperature: str = "", max_tokens: str = "", ignore_eos: bool = False) -> None:
    page = dashboard.page
    if not page.is_visible("#chat-temperature"):
        page.click("#chat-settings summary")
    page.fill("#chat-temperature", temperature)
    page.fill("#chat-max-tokens", max_tokens)
    page.set_checked("#chat-ignore-eos", ignore_eos)


# -- tests --------------------------------------------------------------------------------------------------

def test_a_node_card_says_its_measured_speed_its_share_and_the_bottleneck(speed_placed_nodes: list[NodeProcess],
                                                                          open_page) -> None:
    """Placement by speed, shown: the page's text functions on what /v1/cluster reports per node, and the cards of
    the running cluster: every node's measured speed, each stage's share of a token's time, the bottleneck, and
    for a node the plan leaves out, why."""
    dashboard = open_page(speed_placed_nodes[0])
    result = dashboard.page.evaluate("""async () => {
        const m = await import('/dashboard/topology.js');
        const slow = {speed: {decode_ms_per_layer: 8.0, prefill_ms_per_token: 0.5, measure_seconds: 1.2,
                              cached: false, problem: null}, share: 0.412, bottleneck: true};
        const fast = {...slow, speed: {...slow.speed, decode_ms_per_layer: 0.0423}, share: 0.2, bottleneck: false};
        const measuring = {speed: {decode_ms_per_layer: null, problem: null}, share: null, bottleneck: false};
        const failed = {speed: {decode_ms_per_layer: null, problem: 'cannot measure its speed: no kernel'},
                        share: null, bottleneck: false};
        return [m.speedText(slow), m.speedText(fast), m.speedText(measuring), m.speedText(failed),
                m.speedText({speed: null}),
                m.leftOutText({node_id: 'x', name: 'nas', reason: 'with it the slowest stage takes 9.00 ms per '
                                                                  + 'token, without it 4.00 ms'})];
    }""")
    assert result == ["8.0 ms per layer · 41% of each token · bottleneck", "0.042 ms per layer · 20% of each token",
                      "measuring its speed…", "cannot measure its speed: no kernel", None,
                      "nas holds no layers: with it the slowest stage takes 9.00 ms per token, without it 4.00 ms."]
    view = cluster_of(speed_placed_nodes[0])
    wait_for_ready_cards(dashboard, len(speed_placed_nodes))
    cards = {card["id"]: card["text"] for card in dashboard.cards()}
    # Which nodes hold layers is the placement's call (on one machine a hop may cost more than a tiny layer):
    # each holder shows its share, each node left out says why.
    holders = {stage["node_id"] for stage in view["plan"]["stages"]}
    for node in view["nodes"]:
        assert "per layer" in cards[node["id"]]
        if node["id"] in holders:
            share = math.floor(100 * node["share"] + 0.5)  # as JavaScript's Math.round (Python's halves to even)
            assert f"{share}% of each token" in cards[node["id"]]
    left_out = [entry["name"] for entry in view["placement"]["left_out"]]
    assert {entry["node_id"] for entry in view["placement"]["left_out"]} == {n["id"] for n in view["nodes"]} - holders
    dashboard.wait_for("names => names.every(name => document.getElementById('banners').textContent"
                       ".includes(`${name} holds no layers`))", left_out)
    assert "bottleneck" in cards[view["placement"]["bottleneck"]]
    assert view["placement"]["why"] in dashboard.tile("agreement")


def test_a_node_with_an_api_key_asks_for_it_and_then_shows_the_cluster(browser: Any, tmp_path: Path) -> None:
    key = "dashboard key; with spaces"
    node = start_node(tmp_path / "home", None, "--no-mdns", "--api-key", key)
    page = browser.new_page()
    errors: list[str] = []
    page.on("console", lambda message: message.type == "error" and errors.append(message.text))
    page.on("pageerror", lambda error: errors.append(f"uncaught: {error}"))
    try:
        page.goto(node.base_url + "/")
        page.wait_for_selector("#key-form:not([hidden])", timeout=10_000)
        assert not page.is_visible("main.layout") and not page.is_visible("#nodes")
        page.fill("#key-input", "not the key")
        page.click("#key-form button[type=submit]")
        page.wait_for_function("() => document.querySelector('#key-error').textContent.includes('not this node')")
        page.fill("#key-input", key)
        page.click("#key-form button[type=submit]")
        page.wait_for_selector("#connection[data-state=live]", timeout=10_000)
        page.wait_for_function("() => document.querySelectorAll('#nodes .node').length === 1", timeout=10_000)
        assert page.is_hidden("#key-form") and page.is_visible("main.layout")
        assert [c["name"] for c in page.context.cookies() if c["name"] == "exo_like_api_key"] == ["exo_like_api_key"]
    finally:
        page.context.clear_cookies()
        page.close()
        stop_nodes([node])
    # The only console errors: the browser's own notes of the 401s that made the page ask.
    assert all("401" in error for error in errors), errors


@pytest.fixture
def tiny_pair_without_model(tmp_path: Path) -> Iterator[list[NodeProcess]]:
    """Two nodes with no model and 100 KiB each: any real model is too big for them."""
    nodes = start_cluster(tmp_path, None, [0.0001, 0.0001])
    yield nodes
    stop_nodes(nodes)


def test_no_model_and_a_model_that_does_not_fit_are_explained(tiny_pair_without_model: list[NodeProcess],
                                                              open_page, seven_layers: Path) -> None:
    nodes = tiny_pair_without_model
    dashboard = open_page(nodes[0])
    page = dashboard.page
    dashboard.wait_for("() => document.querySelectorAll('#nodes .node').length === 2", timeout=10)
    assert "No model yet" in page.inner_text("#banners") and "none yet" in dashboard.tile("model")
    assert [c["status"] for c in dashboard.cards()] == ["idle", "idle"]
    # Nothing to pick yet: the picker is a text field; a model too big for the cluster is refused, saying why.
    page.fill("#chat-model", str(seven_layers))
    page.fill("#chat-input", PROMPT)
    dashboard.expected_errors.append(re.compile(r"503 \(Service Unavailable\)"))  # the browser's note of the answer
    page.click("#chat-send")
    page.wait_for_selector(".msg.assistant[data-state=error]", timeout=30_000)
    shown = page.inner_text(".msg.assistant .msg-meta")  # the server's reason, in words
    assert "cannot be loaded: the model does not fit: " in shown and "bytes available" in shown, shown
    assert cluster_of(nodes[0])["instances"] == []  # and nothing else disturbed: no instance was asked for
    assert [c["status"] for c in dashboard.cards()] == ["idle", "idle"]
    dashboard.screenshot("dashboard-does-not-fit-1280x800.png", DESKTOP)


@pytest.fixture
def pair_with_a_model_on_disk(tmp_path: Path) -> Iterator[tuple[list[NodeProcess], Path]]:
    """Two nodes started with no model, and a small checkpoint in the first one's <home>/models: GET /v1/models
    lists it there by its folder's name (source local). Placed by memory, so no speed is measured."""
    checkpoint = make_checkpoint(tmp_path / "home0" / "models" / "pocket", "llama", n_layers=4)
    nodes = start_cluster(tmp_path, None, [1, 1], extra=BY_MEMORY)
    yield nodes, checkpoint
    stop_nodes(nodes)


# Every data-status an instance's row takes, in order (a load on loopback may be over before a picture shows it).
WATCH_INSTANCE_ROWS = """() => {
    window.instanceStates = [];
    const note = () => document.querySelectorAll('#instances .instance').forEach(row => {
        const last = window.instanceStates[window.instanceStates.length - 1];
        if (last !== row.dataset.status) window.instanceStates.push(row.dataset.status);
    });
    new MutationObserver(note).observe(document.getElementById('instances'),
                                       {subtree: true, childList: true, attributes: true});
}"""


def test_a_model_launched_from_the_picker_loads_answers_in_the_chat_and_unloads(
        pair_with_a_model_on_disk: tuple[list[NodeProcess], Path], open_page) -> None:
    """The acceptance path, in the page alone: the picker lists the folder on the node's disk; a launch on a node
    ticked there shows the instance loading then ready (on that node's card as a badge), a launch on the other node a
    second instance there; the chat picker offers the model and answers with the API's greedy text; Unload takes
    them off the page and off /v1/instances. A name the node does not know is refused in the server's words."""
    nodes, checkpoint = pair_with_a_model_on_disk
    dashboard = open_page(nodes[0])
    page = dashboard.page
    dashboard.wait_for("() => document.querySelectorAll('#launch-nodes input').length === 2", timeout=10)
    ids = {node["name"]: node["id"] for node in cluster_of(nodes[0])["nodes"]}
    assert "Nothing loaded" in page.inner_text("#instances")
    assert page.get_attribute("#chat-model", "placeholder").startswith("model:")  # nothing to pick in the chat yet

    # A name no node knows: refused, the server's reason shown, nothing loaded.
    dashboard.expected_errors.append(re.compile(r"404 \(Not Found\)"))  # the browser's note of the answer
    page.fill("#launch-model", "no-such-model")
    page.click("#launch")
    dashboard.wait_for("() => document.querySelector('#launch-status').dataset.state === 'error'", timeout=30)
    refusal = page.inner_text("#launch-status")
    assert refusal.startswith("Could not launch no-such-model: model 'no-such-model' not found"), refusal
    assert nodes[0].get_json("/v1/instances")["data"] == []

    # Picked from the list (the folder, on this node's disk) and launched on node1 alone.
    page.wait_for_selector('#launch-pick option[value="pocket"]', state="attached")
    assert page.text_content('#launch-pick option[value="pocket"]') == "pocket · on disk"
    page.select_option("#launch-pick", "pocket")
    assert page.input_value("#launch-model") == "pocket"
    page.check(f'#launch-nodes input[value="{ids["node1"]}"]')
    page.evaluate(WATCH_INSTANCE_ROWS)
    page.click("#launch")
    dashboard.wait_for("() => document.querySelector('#instances .instance[data-status=ready]') !== null",
                       timeout=60)  # a guard, not a bound
    assert page.inner_text("#launch-status") == "Launched pocket on node1: its instance below shows its load."
    states = page.evaluate("window.instanceStates")
    assert states in (["loading", "ready"], ["ready"]), states  # loading shown while a picture caught it
    [instance] = nodes[0].get_json("/v1/instances")["data"]
    assert instance["model_name"] == "pocket" and instance["model"] == str(checkpoint.resolve())
    assert [stage["node_id"] for stage in instance["plan"]["stages"]] == [ids["node1"]]
    row = page.inner_text("#instances .instance")
    assert "pocket" in row and "ready" in row and "llama" in row and "4 layers" in row, row
    assert "idle · kept until unloaded" in row, row  # launched: kept until unloaded, no keep-alive
    assert page.eval_on_selector_all("#instances .instance-node", "rows => rows.map(r => [r.dataset.nodeId, "
                                     "r.textContent])") == [[ids["node1"], "node1layers 0–3ready"]]
    # The topology: node1's card carries the instance's badge, node0's none.
    badges = page.eval_on_selector_all("#nodes .node", "cards => cards.map(c => [c.dataset.nodeId, "
                                       "[...c.querySelectorAll('.instance-badge')].map(b => b.textContent)])")
    assert dict(badges) == {ids["node0"]: [], ids["node1"]: ["pocketL 0–3"]}

    # Launched again, on node0: a second instance of it there (data parallel), with its own row and badge.
    page.uncheck(f'#launch-nodes input[value="{ids["node1"]}"]')
    page.check(f'#launch-nodes input[value="{ids["node0"]}"]')
    page.click("#launch")
    dashboard.wait_for("() => document.querySelectorAll('#instances .instance[data-status=ready]').length === 2",
                       timeout=60)
    key = instance["id"]
    rows = page.eval_on_selector_all("#instances .instance", "rows => rows.map(r => [r.dataset.instanceId, "
                                     "r.querySelector('.instance-name').textContent, r.querySelector('.unload')"
                                     ".textContent])")
    # The first instance's id is the model's key, which unloads every instance of the model: its button says so.
    assert rows == [[key, "pocket", "Unload all 2"], [f"{key}#2", "pocket#2", "Unload"]]
    badges = page.eval_on_selector_all("#nodes .node", "cards => cards.map(c => [c.dataset.nodeId, "
                                       "[...c.querySelectorAll('.instance-badge')].map(b => b.textContent)])")
    assert dict(badges) == {ids["node0"]: ["pocket#2L 0–3"], ids["node1"]: ["pocketL 0–3"]}

    # The chat offers the model once (the cluster picks the instance), and any other name; it answers with the
    # API's greedy text.
    page.wait_for_selector('#chat-model option[value="pocket"]', state="attached")
    assert page.eval_on_selector_all("#chat-model option", "options => options.map(o => o.value)") == ["pocket", ""]
    assert page.input_value("#chat-model") == "pocket" and page.is_hidden("#chat-model-other")
    page.select_option("#chat-model", "")  # another model…: a field for its name, suggesting what the node lists
    assert page.is_visible("#chat-model-other") and page.get_attribute("#chat-model-other", "list") == "model-names"
    page.select_option("#chat-model", "pocket")
    open_settings(dashboard, temperature="0", max_tokens="8")
    page.fill("#chat-input", PROMPT)
    page.press("#chat-input", "Enter")
    page.wait_for_selector(".msg.assistant[data-state=done]", timeout=60_000)
    streamed = page.eval_on_selector(".msg.assistant .msg-text", "e => e.textContent")
    assert streamed and streamed == greedy_chat(nodes[0], "pocket", PROMPT, 8)["choices"][0]["message"]["content"]
    dashboard.wait_for("() => [...document.querySelectorAll('#instances .instance-use')]"
                       ".every(use => use.textContent.startsWith('idle'))", timeout=30)
    dashboard.screenshot("dashboard-instances-1280x800.png", DESKTOP)
    dashboard.screenshot("dashboard-instances-390-full.png", PHONE, full_page=True)
    page.set_viewport_size(DESKTOP)

    # Unloaded from the page: the second instance alone by its own button (its key has a "#": sent encoded), then
    # the rest; gone from the page and from the cluster; the picker lists the folder on disk again.
    page.click(f"#instances .instance[data-instance-id='{key}#2'] button.unload")
    dashboard.wait_for("() => document.querySelectorAll('#instances .instance').length === 1", timeout=30)
    assert [i["id"] for i in nodes[0].get_json("/v1/instances")["data"]] == [key]
    dashboard.wait_for("() => document.querySelector('#instances .instance button.unload').textContent === 'Unload'",
                       timeout=10)
    page.click("#instances .instance button.unload")
    dashboard.wait_for("() => document.querySelector('#instances .instance') === null", timeout=30)
    assert nodes[0].get_json("/v1/instances")["data"] == []
    assert "Nothing loaded" in page.inner_text("#instances")
    assert page.locator("#nodes .instance-badge").count() == 0
    dashboard.wait_for("() => document.querySelector('#launch-pick option[value=pocket]')?.dataset.state === 'local'",
                       timeout=10)
    dashboard.wait_for("() => document.querySelector('#chat-model').tagName === 'INPUT'")  # nothing to pick again


def test_page_reconnects_by_itself_when_its_node_restarts_and_names_a_peer_it_cannot_link(
        seven_layers: Path, tmp_path: Path, open_page) -> None:
    """A lone node's page says it is on its own; stopped, the page says it lost contact, and it comes back by
    itself when the node starts again on its port. Started again with a --peers entry that cannot be linked, the
    node is alone because of that peer: the page names the peer with the reason, not the generic advice. (One
    node's restart serves both, saving a node start; which banners show does not depend on the model it serves.)"""
    port, missing_port = free_ports(2)
    missing = f"127.0.0.1:{missing_port}"  # say, a --peers entry for a machine where exo-like is not running
    args = (str(seven_layers), "--no-mdns", "--node-name", "phoenix", "--dtype", "float32")
    node = start_node(tmp_path, *args, port=port)
    try:
        dashboard = open_page(node)
        wait_for_ready_cards(dashboard, 1)
        assert "on its own" in dashboard.page.inner_text("#banners")  # a single node says so
        # The browser logs the event stream cut by the shutdown and each failed reconnection: expected here.
        dashboard.expected_errors.append(re.compile(r"ERR_CONNECTION_REFUSED|ERR_INCOMPLETE_CHUNKED_ENCODING"))
        assert node.stop() == 0, node.log()
        dashboard.wait_for("() => document.querySelector('#connection').dataset.state === 'lost'")
        assert "Lost contact" in dashboard.page.inner_text("#banners")
        node = start_node(tmp_path, *args, "--peers", missing, port=port)
        dashboard.wait_for("() => document.querySelector('#connection').dataset.state === 'live'", timeout=10)
        wait_for_ready_cards(dashboard, 1)
        assert dashboard.cards()[0]["name"] == "phoenix"
        assert "Lost contact" not in dashboard.page.inner_text("#banners")

        assert wait_for(lambda: cluster_of(node)["unlinked"], timeout=10)
        [unlinked] = cluster_of(node)["unlinked"]
        assert unlinked["address"] == missing and unlinked["code"] == "unreachable"
        assert unlinked["reason"].startswith("cannot connect (Connection refused)")
        dashboard.wait_for("() => document.querySelector('#banners').textContent.includes('Not linked')")
        banners = dashboard.page.inner_text("#banners")
        assert f"{missing}: {unlinked['reason']}." in banners
        assert "on its own" not in banners  # it is alone because of that peer: the generic advice would mislead
        dashboard.screenshot("dashboard-not-linked-1280x800.png", DESKTOP)
        assert f"not linked with {missing}: cannot connect" in node.log()
        dashboard.page.close()  # before its node stops, which would cut the page's event stream
    finally:
        node.stop()


class PictureServer:
    """The dashboard's routes (the page, its assets, /v1/events) on a loop of their own, streaming the picture of
    an in-process cluster that `build` makes (on that loop: a Cluster schedules its announcements there)."""

    def __init__(self, build: Callable[[], Any]):
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        self.base_url = asyncio.run_coroutine_threadsafe(self._start(build), self.loop).result(timeout=30)

    async def _start(self, build: Callable[[], Any]) -> str:
        self.cluster = build()

        async def index(request: web.Request) -> web.StreamResponse:
            return page()

        async def models(request: web.Request) -> web.Response:
            return web.json_response({"object": "list", "data": [{"id": "m", "state": "serving"}]})

        app = web.Application()
        app.router.add_get("/", index)
        app.router.add_get("/v1/models", models)
        # What the node adds to the picture for its own page: the model's name.
        add_routes(app, lambda: {**picture_of(self.cluster), "model_name": "m"}, asyncio.sleep)
        self.runner = web.AppRunner(app)
        await self.runner.setup()
        site = web.TCPSite(self.runner, "127.0.0.1", 0)
        await site.start()
        return f"http://127.0.0.1:{self.runner.addresses[0][1]}"

    async def _stop(self) -> None:
        await self.runner.cleanup()
        await self.cluster.cluster.stop()
        tasks = [task for task in asyncio.all_tasks() if task is not asyncio.current_task()]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    def close(self) -> None:
        asyncio.run_coroutine_threadsafe(self._stop(), self.loop).result(timeout=30)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(timeout=30)
        self.loop.close()


@pytest.fixture
def tensor_parallel_server() -> Iterator[PictureServer]:
    server = PictureServer(tensor_parallel_cluster)
    yield server
    server.close()


def test_a_tensor_parallel_group_is_drawn_as_one_stage(tensor_parallel_server: PictureServer, open_page) -> None:
    """d alone runs layers 0-2; b leads a (this node) and c through layers 3-6, a slice of each per rank: one band
    on the ring, one box of cards, one segment of the bar; the Ring tile says tensor parallel, the predicted time per
    token of the pipeline against the groups', and the measured one."""
    dashboard = open_page(SimpleNamespace(base_url=tensor_parallel_server.base_url))
    page = dashboard.page
    dashboard.wait_for("() => document.querySelectorAll('#nodes .node').length === 4")
    picture = picture_of(tensor_parallel_server.cluster)
    # The ring: two stages, two arrows; the group's band holds its members' bubbles in rank order.
    assert page.locator("#ring .bubble").count() == 4 and page.locator("#ring path.link").count() == 2
    assert page.get_attribute("#ring .tp-group", "data-leader") == "b"
    assert page.text_content("#ring .tp-caption") == "TP × 3 · L 3–6"
    ranks = page.eval_on_selector_all("#ring .tp-group .bubble", "bubbles => bubbles.map(b => "
                                      "[b.dataset.nodeId, b.querySelector('.member-rank').textContent])")
    assert ranks == [["b", "rank 0/3"], ["a", "rank 1/3"], ["c", "rank 2/3"]]
    assert page.get_attribute("#ring .tp-group .bubble.me", "data-node-id") == "a"
    assert page.get_attribute("#ring svg", "aria-label") == (
        "Ring of 2 stages: name-d → name-b + name-a + name-c (tensor parallel · 3 ranks)")
    # Legible: the band clear of the lone bubble, the arrows ending outside both, "you" under its disc in the band.
    shapes = page.evaluate("""() => {
        const box = (el) => { const r = el.getBoundingClientRect(); return [r.left, r.top, r.right, r.bottom]; };
        const ends = (path) => [0, path.getTotalLength()].map(at => { const p = path.getPointAtLength(at);
                                                                         return [p.x, p.y]; });
        const rect = document.querySelector('#ring .tp-band');
        const disc = document.querySelector('#ring .bubble[data-node-id=d] .disc');
        return {band: ['x', 'y', 'width', 'height'].map(a => Number(rect.getAttribute(a))),
                lone: ['cx', 'cy', 'r'].map(a => Number(disc.getAttribute(a))),
                ends: [...document.querySelectorAll('#ring path.link')].flatMap(ends),
                bandBox: box(rect), you: box(document.querySelector('#ring .tp-group .bubble-you')),
                discs: [...document.querySelectorAll('#ring .tp-group .disc')].map(box)};
    }""")
    (bx, by, bw, bh), (cx, cy, r) = shapes["band"], shapes["lone"]
    assert by > cy + r or by + bh < cy - r or bx > cx + r or bx + bw < cx - r

    def outside(point: list[float]) -> bool:
        x, y = point
        in_band = bx <= x <= bx + bw and by <= y <= by + bh
        return not in_band and math.dist((x, y), (cx, cy)) > r

    assert len(shapes["ends"]) == 4 and all(outside(end) for end in shapes["ends"])

    def overlap(a: list[float], b: list[float]) -> bool:
        return a[0] < b[2] and b[0] < a[2] and a[1] < b[3] and b[1] < a[3]

    you, band = shapes["you"], shapes["bandBox"]
    assert band[0] <= you[0] and you[2] <= band[2] and band[1] <= you[1] and you[3] <= band[3]
    assert not any(overlap(you, disc) for disc in shapes["discs"])
    # The cards: d's, then the group's box (what they share above its members' cards, in rank order).
    assert page.eval_on_selector_all("#nodes > li", "items => items.map(i => i.className)") == [
        "node status-ready", "stage-group"]
    head = page.inner_text("#nodes .stage-group .group-head")
    assert "tensor parallel · 3 ranks" in head and "layers 3–6 · 4 of 7" in head
    assert page.inner_text("#nodes .stage-group .group-times") == (
        "predicted 3.0 ms · measured 3.4 ms per token · 60% of each token · bottleneck")
    cards = dashboard.cards()
    assert [(c["id"], c["start"], c["end"], c["you"]) for c in cards] == [
        ("d", 0, 3, False), ("b", 3, 7, False), ("a", 3, 7, True), ("c", 3, 7, False)]
    text = {c["id"]: c["text"] for c in cards}
    assert "rank 0/3 · leader" in text["b"] and "rank 1/3" in text["a"] and "rank 2/3" in text["c"]
    assert "rank" not in text["d"] and "40% of each token" in text["d"]
    assert "1.9 ms per token" in text["d"] and "3.4 ms per token" in text["b"]  # the measured steps
    # A follower shows its rank instead of a share of the time per token; the leader has the group's share.
    assert "1.1 ms per layer · rank 2/3: a slice of each layer" in text["c"] and "% of each token" not in text["c"]
    assert "1.1 ms per layer · 60% of each token · bottleneck" in text["b"]
    # The bar of layers: the group's range once.
    segments = page.eval_on_selector_all("#layer-bar .segment", "segments => segments.map(s => s.textContent)")
    assert segments == ["name-d0–2", "name-b + name-a + name-c3–6TP × 3"]
    assert page.inner_text("#layers-caption") == "7 layers over 2 stages on 4 nodes"
    assert page.inner_text("#ring-caption") == "4 nodes in 2 stages, in pipeline order"
    # The Ring tile: the mode, why, the predicted time per token of both plans (the one taken marked) and the
    # measured one.
    tile = dashboard.tile("agreement")
    assert page.inner_text(".placement-mode") == "tensor parallel"
    assert picture["placement"]["why"] in tile
    assert page.inner_text(".placement-times") == ("predicted per token: pipeline 7.5 ms · tensor 5.0 ms · slowest "
                                                   "stage 3.0 ms · measured 5.3 ms per token")
    assert page.inner_text(".placement-times .chosen") == "tensor 5.0 ms"
    dashboard.screenshot("dashboard-tensor-parallel-1280x800.png", DESKTOP)
    dashboard.screenshot("dashboard-tensor-parallel-390-full.png", PHONE, full_page=True)


def test_chat_shows_token_probabilities_and_tool_calls(tools_node: NodeProcess, tools_checkpoint: Path,  # noqa: F811
                                                       open_page) -> None:
    """With probabilities on, the answer is the API's greedy text, one span per token with its probability; with
    tools and tool choice `required`, the call the model makes shows with its arguments."""
    dashboard = open_page(tools_node)
    wait_for_ready_cards(dashboard, 1)
    page = dashboard.page
    page.wait_for_selector("#chat-model option", state="attached")
    open_settings(dashboard, temperature="0", max_tokens="8")
    page.set_checked("#chat-logprobs", True)
    page.fill("#chat-input", PROMPT)
    page.press("#chat-input", "Enter")
    page.wait_for_selector(".msg.assistant[data-state=done]", timeout=60_000)
    answer = greedy_chat(tools_node, tools_checkpoint.name, PROMPT, 8)["choices"][0]["message"]["content"]
    assert page.eval_on_selector(".msg.assistant .msg-text", "e => e.textContent") == answer
    titles = page.eval_on_selector_all(".msg.assistant .tok", "spans => spans.map(s => s.title)")
    assert titles and all("%" in title for title in titles)

    page.click("#chat-clear")
    page.set_checked("#chat-logprobs", False)
    page.fill("#chat-tools", json.dumps([WEATHER]))
    page.select_option("#chat-tool-choice", "required")
    page.fill("#chat-max-tokens", "200")
    page.fill("#chat-input", "Weather in Paris?")
    page.press("#chat-input", "Enter")
    page.wait_for_selector(".msg.assistant[data-state=done]", timeout=60_000)
    assert page.inner_text(".tool-call .tool-name") == "get_weather"
    arguments = json.loads(page.inner_text(".tool-call .tool-args"))
    assert set(arguments) == {"city", "unit"}


# -- on the module's three nodes: after the tests with nodes of their own, so these are not started (idle) beside
# theirs; the test that kills one of them last -----------------------------------------------------------------

def test_page_lists_the_nodes_their_memory_and_layers_as_v1_cluster_does(three_nodes: list[NodeProcess],
                                                                         open_page, seven_layers: Path) -> None:
    dashboard = open_page(three_nodes[0])
    wait_for_ready_cards(dashboard, 3)
    view = cluster_of(three_nodes[0])
    nodes = {n["id"]: n for n in view["nodes"]}
    stages = view["plan"]["stages"]
    cards = dashboard.cards()
    assert [c["id"] for c in cards] == [s["node_id"] for s in stages]  # pipeline order
    for card, stage in zip(cards, stages):
        node = nodes[stage["node_id"]]
        assert card["name"] == node["name"]
        assert (card["start"], card["end"]) == (stage["start_layer"], stage["end_layer"])
        layers = format_layers(stage["start_layer"], stage["end_layer"])
        assert f"{layers} · {stage['end_layer'] - stage['start_layer']} of 7" in card["text"]
        assert f"{format_bytes(node['used_bytes'])} used of {format_bytes(node['memory_bytes'])}" in card["text"]
        assert node["address"] in card["text"] and card["you"] == (node["id"] == view["node_id"])
    assert [c["name"] for c in cards] == ["node0", "node1", "node2"]
    assert "6.0 GiB" in cards[0]["text"] and "1.0 GiB" in cards[2]["text"]
    assert "10.0 GiB" in dashboard.tile("memory")
    assert view["plan"]["digest"] in dashboard.tile("agreement") and "agreed" in dashboard.tile("agreement")
    assert seven_layers.name in dashboard.tile("model") and "7 layers" in dashboard.tile("model")
    assert "default" in dashboard.tile("key")
    ring = dashboard.page.eval_on_selector_all("#ring .bubble", "els => els.map(e => e.dataset.nodeId)")
    assert ring == [s["node_id"] for s in stages]
    assert dashboard.page.locator("#ring path.link[marker-end]").count() == 3  # one arrow per hop, back to the start
    assert dashboard.page.get_attribute("#ring .bubble.me", "data-node-id") == view["node_id"]


def test_every_node_serves_the_same_view(three_nodes: list[NodeProcess], open_page) -> None:
    dashboards = [open_page(node) for node in three_nodes]
    for node, dashboard in zip(three_nodes, dashboards):
        wait_for_ready_cards(dashboard, 3)
        assert [c["id"] for c in dashboard.cards() if c["you"]] == [cluster_of(node)["node_id"]]

    def views() -> list[tuple]:
        return [([(c["id"], c["name"], c["status"], c["start"], c["end"]) for c in dashboard.cards()],
                 dashboard.tile("agreement"), dashboard.tile("memory")) for dashboard in dashboards]

    # Compared side by side until they settle: the ring tile's predicted time per token follows the links'
    # lowest round trips, which fall as samples come in (on a busy machine the first ones are slow), and each
    # node shows the change once the announcement reaches it.
    def alike() -> bool:
        seen = views()
        return all(view == seen[0] for view in seen)

    assert wait_for(alike, timeout=20), views()


def test_chat_streams_the_same_greedy_answer_as_the_api(three_nodes: list[NodeProcess], open_page,
                                                        seven_layers: Path) -> None:
    dashboard = open_page(three_nodes[1])
    wait_for_ready_cards(dashboard, 3)
    page = dashboard.page
    page.wait_for_selector("#chat-model option", state="attached")
    assert page.input_value("#chat-model") == seven_layers.name  # the picker lists /v1/models
    open_settings(dashboard, temperature="0", max_tokens=str(MAX_TOKENS))
    page.fill("#chat-input", PROMPT)
    page.press("#chat-input", "Enter")
    page.wait_for_selector(".msg.assistant[data-state=done]", timeout=60_000)
    streamed = page.eval_on_selector(".msg.assistant .msg-text", "e => e.textContent")
    answer = greedy_chat(three_nodes[1], seven_layers.name, PROMPT, MAX_TOKENS)
    assert streamed == answer["choices"][0]["message"]["content"]
    meta = page.inner_text(".msg.assistant .msg-meta")
    assert f"{answer['usage']['completion_tokens']} tokens" in meta and "first token" in meta, meta
    assert page.inner_text(".msg.user .msg-text") == PROMPT
    # Settled before the screenshot: both requests finished on every node.
    dashboard.wait_for("() => document.querySelector('[data-tile=requests]').textContent.includes('0 in flight')"
                       " && [...document.querySelectorAll('#nodes .node')].every(c => c.dataset.status === 'ready')")
    dashboard.screenshot("dashboard-1280x800.png", DESKTOP)
    dashboard.screenshot("dashboard-390x844.png", PHONE)
    dashboard.screenshot("dashboard-390-full.png", PHONE, full_page=True)


def test_stop_cancels_the_request_on_every_node(three_nodes: list[NodeProcess], open_page) -> None:
    dashboard = open_page(three_nodes[0])
    wait_for_ready_cards(dashboard, 3)
    page = dashboard.page
    page.wait_for_selector("#chat-model option", state="attached")
    open_settings(dashboard, max_tokens="100000", ignore_eos=True)  # far longer than the test waits
    page.fill("#chat-input", "Write a very long poem.")
    page.click("#chat-send")
    text = ".msg.assistant[data-state=streaming] .msg-text"
    dashboard.wait_for(f"() => document.querySelector('{text}')?.textContent.length > 0", timeout=30)
    first = len(page.eval_on_selector(text, "e => e.textContent"))
    dashboard.wait_for(f"n => document.querySelector('{text}')?.textContent.length > n", first)  # it streams
    # While it runs, every node's card is busy with a live rate and its layers' time per token: numbers shared
    # in the announcements.
    dashboard.wait_for("() => { const cards = [...document.querySelectorAll('#nodes .node')];"
                       " return cards.length === 3 && cards.every(c => c.dataset.status === 'busy'"
                       " && c.querySelector('.node-tps').textContent !== '0 tok/s'"
                       " && /^[0-9.]+ ms per token$/.test(c.querySelector('.node-step')?.textContent ?? '')); }")
    assert "1 in flight" in dashboard.tile("requests")
    assert three_nodes[0].get_json("/v1/debug/requests")["in_flight_requests"] == 1
    dashboard.screenshot("dashboard-generating-1280x800.png", DESKTOP)
    page.click("#chat-stop")
    page.wait_for_selector(".msg.assistant[data-state=stopped]", timeout=5_000)
    assert page.is_visible("#chat-send") and not page.is_visible("#chat-stop")
    assert page.inner_text(".msg.assistant .msg-meta").startswith("Stopped.")

    def stopped_everywhere() -> list[dict[str, Any]] | None:
        debug = [node.get_json("/v1/debug/requests") for node in three_nodes]
        idle = all(d["in_flight_requests"] == 0 and d["requests"] == [] and d["active_kv_caches"] == 0 for d in debug)
        return debug if idle else None

    assert wait_for(stopped_everywhere, timeout=5), [n.get_json("/v1/debug/requests") for n in three_nodes]
    dashboard.wait_for("() => [...document.querySelectorAll('#nodes .node')].every(c => c.dataset.status === 'ready')")


def test_a_downloading_node_says_how_far_it_is(three_nodes: list[NodeProcess], open_page) -> None:
    """The page's own status rules, run in the browser on the download object /v1/cluster reports per node."""
    dashboard = open_page(three_nodes[0])
    result = dashboard.page.evaluate("""async () => {
        const m = await import('/dashboard/topology.js');
        const downloading = {status: 'loading', busy: false, problem: null,
                             download: {state: 'downloading', percent: 42.7}};
        const finished = {...downloading, download: {state: 'done', percent: 100}};
        const failing = {...downloading, problem: 'cannot reach the hub'};
        const status = m.displayStatus(downloading);
        return [status, m.statusLabel(downloading, status), m.displayStatus(finished), m.displayStatus(failing)];
    }""")
    assert result == ["downloading", "downloading 42 %", "loading", "problem"]


def test_the_models_panel_shows_each_instance_and_its_nodes(three_nodes: list[NodeProcess], open_page,
                                                             seven_layers: Path) -> None:
    """The --model instance on three nodes: listed ready in the Models panel with each node's layers, and a badge on
    every card; a loading instance (the panel's own functions, on what /v1/instances reports) says what each node
    does, a download's progress included, and a kept-alive one when it unloads."""
    dashboard = open_page(three_nodes[0])
    wait_for_ready_cards(dashboard, 3)
    page = dashboard.page
    view = cluster_of(three_nodes[0])
    [instance] = view["instances"]
    names = {node["id"]: node["name"] for node in view["nodes"]}
    dashboard.wait_for("() => ['ready', 'busy'].includes(document.querySelector('#instances .instance')"
                       "?.dataset.status)")
    assert page.get_attribute("#instances .instance", "data-instance-id") == instance["id"]
    nodes = page.eval_on_selector_all("#instances .instance-node", "rows => rows.map(r => r.dataset.nodeId)")
    assert nodes == [stage["node_id"] for stage in instance["plan"]["stages"]]
    badges = page.eval_on_selector_all("#nodes .node", "cards => cards.map(c => [c.dataset.nodeId, "
                                       "[...c.querySelectorAll('.instance-badge')].map(b => b.textContent)])")
    spans = {stage["node_id"]: format_layers(stage["start_layer"], stage["end_layer"]).split(" ")[1]  # "4–5", "6"
             for stage in instance["plan"]["stages"]}
    assert dict(badges) == {node_id: [f"{seven_layers.name}L {span}"] for node_id, span in spans.items()}
    assert page.inner_text("#ring-caption") == "3 nodes in pipeline order"  # one instance: no need to say whose

    loading = {**instance, "ready": False, "agreed": True, "in_flight": 0, "expires_in_seconds": 283.4,
               "waiting_for": "nodes x are still loading their layers",
               "nodes": {node_id: {**part, "status": "ready" if part["stage"] == 0 else "loading"}
                         for node_id, part in instance["nodes"].items()}}
    downloading = {"label": "m layers [4, 6)", "state": "downloading", "done_bytes": 40 << 20,
                   "total_bytes": 100 << 20, "percent": 40.0}
    members = [{**node, "download": downloading if part["stage"] == 1 else None}
               for node in view["nodes"] for part in [instance["nodes"][node["id"]]]]
    result = page.evaluate("""async ([instance, members]) => {
        const m = await import('/dashboard/models.js');
        const byId = new Map(members.map(node => [node.id, node]));
        return [m.instanceStatus(instance), m.useText(instance),
                m.nodeStates(instance, byId).map(s => [s.name, s.layers, s.text, s.percent]),
                m.useText({...instance, in_flight: 2, expires_in_seconds: null}),
                m.instanceStatus({...instance, problem: 'cannot load'}),
                m.modelText({id: 'llama-3.2-1b', state: 'not_downloaded', parameters: 1235814400,
                             size_bytes: 2471628800})];
    }""", [loading, members])
    stages = instance["plan"]["stages"]
    assert result == [
        "loading", "idle · unloads in 4 min 43 s if idle",
        [[names[stages[0]["node_id"]], format_layers(stages[0]["start_layer"], stages[0]["end_layer"]), "ready", None],
         [names[stages[1]["node_id"]], format_layers(stages[1]["start_layer"], stages[1]["end_layer"]),
          "downloading 40 % (40.0 MiB of 100.0 MiB)", 40],
         [names[stages[2]["node_id"]], format_layers(stages[2]["start_layer"], stages[2]["end_layer"]),
          "loading layers", None]],
        "2 requests in flight · kept until unloaded", "problem",
        "llama-3.2-1b · not downloaded · 1.2B parameters · 2.3 GiB"]


def test_a_node_long_inside_one_step_says_so(three_nodes: list[NodeProcess], open_page) -> None:
    """A hung engine keeps its node alive: the page tells it apart from an ordinary busy node by step_seconds."""
    dashboard = open_page(three_nodes[0])
    result = dashboard.page.evaluate("""async () => {
        const m = await import('/dashboard/topology.js');
        const computing = {status: 'ready', busy: true, problem: null, step_seconds: 0.4};
        const stuck = {...computing, step_seconds: 42.9};
        const status = m.displayStatus(stuck);
        return [m.displayStatus(computing), status, m.statusLabel(stuck, status)];
    }""")
    assert result == ["busy", "slow-step", "one step for 42 s"]


def test_a_request_recovering_from_a_lost_node_says_which_node_it_lost(three_nodes: list[NodeProcess],
                                                                       open_page) -> None:
    """The card of the node whose clients' requests are paused names the node they lost; a banner says it too."""
    dashboard = open_page(three_nodes[0])
    result = dashboard.page.evaluate("""async () => {
        const m = await import('/dashboard/topology.js');
        return [m.recoveryText({recovering: {node1: 2}, replays: 3}), m.recoveryText({recovering: {}, replays: 1}),
                m.recoveryText({recovering: {'': 1}, replays: 1}), m.recoveryText({recovering: {}, replays: 0})];
    }""")
    assert result == ["2 requests recovering: lost node1, replaying on the re-formed ring · 3 requests resumed after "
                      "a lost node or a re-plan", "1 request resumed after a lost node or a re-plan",
                      "1 request recovering: the ring re-formed, replaying · 1 request resumed after a lost node or "
                      "a re-plan", None]


def test_a_killed_node_shows_unreachable_and_the_new_layer_ranges_at_once(three_nodes: list[NodeProcess],
                                                                          open_page) -> None:
    """On the module's three nodes, after every other test that uses them: none runs on a cluster short of one."""
    nodes = three_nodes
    dashboard = open_page(nodes[0])
    wait_for_ready_cards(dashboard, 3)
    lost = cluster_of(nodes[1])["node_id"]
    nodes[1].process.send_signal(signal.SIGKILL)
    # 7 layers over the 6 and 1 GiB that are left: [0, 6) and [6, 7); no reload in between.
    dashboard.wait_for("lost => { const cards = [...document.querySelectorAll('#nodes .node')];"
                       " const ranges = cards.filter(c => c.dataset.start)"
                       "   .map(c => c.dataset.start + '-' + c.dataset.end).join();"
                       " return ranges === '0-6,6-7' && cards.some(c => c.dataset.nodeId === lost"
                       " && c.dataset.status === 'unreachable'); }", lost, timeout=60)  # a guard, not a bound
    view = cluster_of(nodes[0])
    cards = dashboard.cards()
    assert [(c["id"], c["start"], c["end"]) for c in cards if c["status"] != "unreachable"] == [
        (s["node_id"], s["start_layer"], s["end_layer"]) for s in view["plan"]["stages"]]
    assert [c["name"] for c in cards if c["status"] == "unreachable"] == ["node1"]
    assert dashboard.page.locator("#ring .bubble").count() == 2
    assert "node1" in dashboard.page.inner_text("#banners")
    dashboard.screenshot("dashboard-node-lost-1280x800.png", DESKTOP)
