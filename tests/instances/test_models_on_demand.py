"""Models on demand, as a user meets them: three nodes started without a model serve whichever model a request names
(each exact against transformers), several at once, unloading an idle one when a new one needs its memory, one at
once with keep_alive 0, and refusing a model that can never fit with a clear error while the others serve.

Memory is set so that what fits follows from the bytes alone: the nodes place by memory (no speed measured), and
each offers 0.00066 GiB (708 KB): models A (504 KB) and B (661 KB) fit together, C (1.2 MB) fits beside one of
them only, D (4.3 MB) nowhere."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.api_server import NodeProcess, stop_nodes, wait_for
from tests.checkpoints import make_checkpoint
from tests.cluster_harness import cluster_of, start_cluster
from tests.oracle import Oracle

PROMPT = "Tell me a story."
MEMORY_GB = 0.00066
MODELS = {"a": ("qwen2", 2, 0), "b": ("llama", 2, 1), "c": ("qwen2", 6, 2), "d": ("qwen2", 24, 3)}


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("on-demand-models")
    return {name: make_checkpoint(root / name, arch, n_layers=layers, seed=seed)
            for name, (arch, layers, seed) in MODELS.items()}


@pytest.fixture
def nodes(tmp_path: Path) -> Iterator[list[NodeProcess]]:
    started = start_cluster(tmp_path, None, [MEMORY_GB] * 3, extra=("--placement", "memory"))
    yield started
    assert stop_nodes(started) == [0, 0, 0], [node.log() for node in started]
    assert not any("Traceback" in node.log() for node in started), [node.log() for node in started]


def expected(model: Path, max_tokens: int) -> str:
    oracle = Oracle(model)
    return oracle.expected(oracle.chat_ids(PROMPT), max_tokens)[0]


def loaded(node: NodeProcess) -> list[str]:
    """The models /api/ps lists, by the last part of their names (the checkpoints' folders)."""
    return sorted(Path(entry["name"]).name for entry in node.get_json("/api/ps")["models"])


def test_three_nodes_serve_the_models_requests_name_and_make_room_for_them(nodes: list[NodeProcess],
                                                                        models: dict[str, Path]) -> None:
    import ollama
    import openai

    clients = [openai.OpenAI(base_url=f"{node.base_url}/v1", api_key="none", max_retries=0) for node in nodes]
    ollamas = [ollama.Client(host=node.base_url) for node in nodes]
    assert cluster_of(nodes[0])["instances"] == []

    def chat(i: int, name: str, max_tokens: int = 12) -> str:
        reply = clients[i].chat.completions.create(model=str(models[name]), max_tokens=max_tokens, temperature=0,
                                                   messages=[{"role": "user", "content": PROMPT}])
        return reply.choices[0].message.content

    assert chat(0, "a") == expected(models["a"], 12)

    # While a stream of A is open, B is asked for on another node (Ollama's client) and loaded beside it.
    stream = clients[1].chat.completions.create(model=str(models["a"]), max_tokens=40, temperature=0, stream=True,
                                                messages=[{"role": "user", "content": PROMPT}])
    chunks = iter(stream)
    first = next(chunks)
    b_reply = ollamas[2].chat(model=str(models["b"]), messages=[{"role": "user", "content": PROMPT}],
                              options={"temperature": 0, "num_predict": 12})
    assert b_reply.message.content == expected(models["b"], 12)
    streamed = "".join(c.choices[0].delta.content or "" for c in [first, *chunks] if c.choices)
    assert streamed == expected(models["a"], 40)
    assert loaded(nodes[0]) == ["a", "b"] and len(cluster_of(nodes[1])["instances"]) == 2
    assert [m.model for m in ollamas[0].ps().models] == [e["name"] for e in nodes[0].get_json("/api/ps")["models"]]

    # C fits beside one of them only: the least recently used idle one goes (B: A is used once more first, on the
    # node C is then asked on, which decides what goes; which of the two requests above ended last depends on how
    # the nodes' engine threads interleaved them, and a peer's use reaches that node with its next announcement).
    assert chat(2, "a", 4) == expected(models["a"], 4)
    assert chat(2, "c") == expected(models["c"], 12)
    assert wait_for(lambda: all(loaded(node) == ["a", "c"] for node in nodes), timeout=30), \
        [loaded(node) for node in nodes]

    # keep_alive 0: A goes as soon as its request ends.
    generated = ollamas[1].generate(model=str(models["a"]), prompt=PROMPT, keep_alive=0,
                                    options={"temperature": 0, "num_predict": 4})
    assert generated.done
    assert wait_for(lambda: loaded(nodes[0]) == ["c"], timeout=30), loaded(nodes[0])

    # D never fits: a clear error while C goes on serving, undisturbed.
    c_stream = clients[0].chat.completions.create(model=str(models["c"]), max_tokens=40, temperature=0, stream=True,
                                                  messages=[{"role": "user", "content": PROMPT}])
    c_chunks = iter(c_stream)
    c_first = next(c_chunks)
    refused: list[BaseException] = []
    asking = threading.Thread(target=lambda: _refused(refused, lambda: chat(1, "d")))
    asking.start()
    asking.join(60)
    (error,) = refused
    assert isinstance(error, openai.APIStatusError) and error.status_code == 503, error
    message = error.body["message"]
    # ("cannot be loaded beside C (serving requests): ..." while C's stream still runs, else without "beside")
    assert "cannot be loaded" in message and "the model does not fit: the model needs" in message, message
    assert "bytes in total; the cluster has" in message and "bytes available" in message, message
    streamed = "".join(c.choices[0].delta.content or "" for c in [c_first, *c_chunks] if c.choices)
    assert streamed == expected(models["c"], 40)
    assert loaded(nodes[2]) == ["c"]


def _refused(errors: list[BaseException], call) -> None:  # type: ignore[no-untyped-def]
    try:
        call()
    except BaseException as exc:  # noqa: BLE001  (what the client raised is what the test checks)
        errors.append(exc)
