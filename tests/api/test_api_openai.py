"""The OpenAI API of a real `exo-like` process, through the official `openai` client.

The oracle is Hugging Face transformers on the same checkpoint: its tokenizer for prompts and usage, its
greedy `generate` for outputs.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import openai
import pytest

from tests.api_server import NodeProcess, checkpoint, node, start_node, wait_for  # noqa: F401  (fixtures)
from tests.oracle import Oracle
from tests.step_metrics import batch_rows, own_entry, steps

MAX_TOKENS = 40
# Prompts whose greedy continuations contain characters split across tokens (found by search; the test
# asserts that at least one of them really does, so a changed checkpoint cannot make the check vacuous).
SPLIT_PROMPTS = ["café ±×÷", "café 🙂", "Hello café", "fox 42"]
PROMPTS = ["Hello!", "What is the capital of France?", *SPLIT_PROMPTS]


@pytest.fixture(scope="module")
def oracle(checkpoint: Path) -> Oracle:  # noqa: F811
    return Oracle(checkpoint)


@pytest.fixture(scope="module")
def client(node: NodeProcess) -> openai.OpenAI:  # noqa: F811
    return openai.OpenAI(base_url=node.base_url + "/v1", api_key="unused", max_retries=0, timeout=60)


@pytest.fixture(scope="module")
def model_id(checkpoint: Path) -> str:  # noqa: F811
    return checkpoint.name


def chat(client: openai.OpenAI, model: str, content: str, **kwargs):  # type: ignore[no-untyped-def]
    return client.chat.completions.create(model=model, messages=[{"role": "user", "content": content}], **kwargs)


def test_models_lists_the_served_model(client: openai.OpenAI, model_id: str, checkpoint: Path) -> None:  # noqa: F811
    models = list(client.models.list())
    assert (models[0].id, models[0].state) in ((model_id, "loading"), (model_id, "serving"))  # first; the catalog
    # follows; "serving" once its instance is loaded
    assert wait_for(lambda: list(client.models.list())[0].state == "serving", timeout=60)
    models = list(client.models.list())
    assert [m.id for m in models if m.state == "serving"] == [model_id]
    assert client.models.retrieve(model_id).id == model_id
    # The path the node was started with is accepted as the model name as well.
    response = chat(client, str(checkpoint), "Hello!", max_tokens=2, temperature=0)
    assert response.model == model_id


@pytest.mark.parametrize("prompt", PROMPTS)
def test_greedy_chat_equals_transformers(client: openai.OpenAI, oracle: Oracle, model_id: str, prompt: str) -> None:
    response = chat(client, model_id, prompt, max_tokens=MAX_TOKENS, temperature=0)
    prompt_ids = oracle.chat_ids(prompt)
    text, finish, count = oracle.expected(prompt_ids, MAX_TOKENS)
    choice = response.choices[0]
    assert choice.message.role == "assistant"
    assert choice.message.content == text
    assert choice.finish_reason == finish
    assert response.object == "chat.completion"
    assert response.usage.prompt_tokens == len(prompt_ids)
    assert response.usage.completion_tokens == count
    assert response.usage.total_tokens == len(prompt_ids) + count


def test_greedy_completion_equals_transformers(client: openai.OpenAI, oracle: Oracle, model_id: str) -> None:
    prompt = "The quick brown fox"
    prompt_ids = oracle.completion_ids(prompt)  # with BOS: a plain prompt gets special tokens
    text, finish, count = oracle.expected(prompt_ids, MAX_TOKENS)
    response = client.completions.create(model=model_id, prompt=prompt, max_tokens=MAX_TOKENS, temperature=0)
    assert (response.choices[0].text, response.choices[0].finish_reason) == (text, finish)
    assert (response.usage.prompt_tokens, response.usage.completion_tokens) == (len(prompt_ids), count)
    # The same prompt as token ids, and as a list of one string, gives the same completion.
    by_ids = client.completions.create(model=model_id, prompt=list(prompt_ids), max_tokens=MAX_TOKENS, temperature=0)
    as_list = client.completions.create(model=model_id, prompt=[prompt], max_tokens=MAX_TOKENS, temperature=0)
    assert by_ids.choices[0].text == as_list.choices[0].text == text


def test_long_prompt_prefilled_in_chunks_equals_transformers(client: openai.OpenAI, oracle: Oracle,
                                                            node: NodeProcess, checkpoint: Path,  # noqa: F811
                                                            model_id: str) -> None:
    """The chunks observed in the node's /metrics (rows per engine step): the prompt's rows went through in
    steps of at most the scheduler's batch (512 rows on a CPU), then one step per further token."""
    limit = batch_rows(node)
    context = json.loads((checkpoint / "config.json").read_text())["max_position_embeddings"]
    items = 150
    while len(oracle.chat_ids(long_prompt(items))) <= min(2 * limit, context // 2):  # (an accelerator's batch: 2048)
        items += 50
    prompt = long_prompt(items)
    prompt_ids = oracle.chat_ids(prompt)
    text, finish, count = oracle.expected(prompt_ids, 8)
    hits_before, before = own_entry(node)["prefix_hits"], steps(node)
    response = chat(client, model_id, prompt, max_tokens=8, temperature=0)
    taken, computed = steps(node) - before, len(prompt_ids) - (own_entry(node)["prefix_hits"] - hits_before)
    assert response.choices[0].message.content == text
    assert response.usage.prompt_tokens == len(prompt_ids)
    chunks = -(-computed // limit)
    assert chunks >= 2, (computed, limit)  # more than one step's worth: the check below can see chunking
    assert taken.over(limit) == 0, taken  # no step took more than one chunk's rows
    assert taken.count == chunks + count - 1, (taken, chunks, count)  # the chunks, then a step per further token
    assert taken.rows == computed + count - 1, (taken, computed, count)


def long_prompt(items: int) -> str:
    return " ".join(f"item {i} of the list, café {i * 7}" for i in range(items))


def _stream_chat(client: openai.OpenAI, model_id: str, prompt: str,  # type: ignore[no-untyped-def]
                 **kwargs) -> tuple[list, str]:
    chunks = list(chat(client, model_id, prompt, stream=True, **kwargs))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    return chunks, text


def test_streamed_chat_concatenates_to_the_whole_text(client: openai.OpenAI, oracle: Oracle, model_id: str) -> None:
    splitting = [p for p in SPLIT_PROMPTS
                 if oracle.splits_a_character(oracle.generate(oracle.chat_ids(p), MAX_TOKENS))]
    assert splitting, "no prompt makes the model split a UTF-8 character across tokens; pick new SPLIT_PROMPTS"
    for prompt in SPLIT_PROMPTS:
        whole = chat(client, model_id, prompt, max_tokens=MAX_TOKENS, temperature=0)
        chunks, text = _stream_chat(client, model_id, prompt, max_tokens=MAX_TOKENS, temperature=0,
                                    stream_options={"include_usage": True})
        assert text == whole.choices[0].message.content
        assert "\ufffd" not in "".join(c.choices[0].delta.content or "" for c in chunks[:1] if c.choices)
        assert chunks[0].object == "chat.completion.chunk"
        assert chunks[0].choices[0].delta.role == "assistant"
        assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == whole.choices[0].finish_reason
        assert chunks[-1].choices == [] and chunks[-1].usage == whole.usage
        assert all(c.usage is None for c in chunks[:-1])
        assert len({c.id for c in chunks}) == 1


def test_streamed_deltas_never_break_a_character(client: openai.OpenAI, oracle: Oracle, model_id: str) -> None:
    """Each delta is what a client may show at once: every concatenated prefix must be a prefix of the end text
    (a naive per-token decode would emit U+FFFD for half a character and then the character itself)."""
    for prompt in SPLIT_PROMPTS:
        chunks, text = _stream_chat(client, model_id, prompt, max_tokens=MAX_TOKENS, temperature=0)
        shown = ""
        for chunk in chunks:
            if chunk.choices and chunk.choices[0].delta.content:
                shown += chunk.choices[0].delta.content
                assert text.startswith(shown)
        assert text == oracle.expected(oracle.chat_ids(prompt), MAX_TOKENS)[0]


def test_streamed_completion_concatenates_to_the_whole_text(client: openai.OpenAI, model_id: str) -> None:
    kwargs = dict(model=model_id, prompt="café ±×÷", max_tokens=MAX_TOKENS, temperature=0)
    whole = client.completions.create(**kwargs)
    chunks = list(client.completions.create(stream=True, **kwargs))
    assert all(c.object == "text_completion" for c in chunks)
    assert "".join(c.choices[0].text for c in chunks) == whole.choices[0].text
    assert chunks[-1].choices[0].finish_reason == "length"
    assert all(c.usage is None for c in chunks)  # no usage chunk unless asked for


def test_stop_strings_cut_the_text(client: openai.OpenAI, oracle: Oracle, model_id: str,
                                   node: NodeProcess) -> None:  # noqa: F811
    prompt = "Hello!"
    full = oracle.expected(oracle.chat_ids(prompt), MAX_TOKENS)[0]
    stop = full[12:15]
    assert stop and full.find(stop) > 0
    expected = full[: full.find(stop)]
    response = chat(client, model_id, prompt, max_tokens=MAX_TOKENS, temperature=0, stop=stop)
    assert (response.choices[0].message.content, response.choices[0].finish_reason) == (expected, "stop")
    assert response.usage.completion_tokens < MAX_TOKENS
    chunks, text = _stream_chat(client, model_id, prompt, max_tokens=MAX_TOKENS, temperature=0,
                                stop=["never appears", stop])
    assert text == expected
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "stop"
    # Stopping early on a stop string frees the request's KV cache.
    assert wait_for(lambda: node.get_json("/health")["active_kv_caches"] == 0)


def test_text_parts_and_developer_role(client: openai.OpenAI, model_id: str) -> None:
    def reply(messages: list) -> str:  # type: ignore[type-arg]
        response = client.chat.completions.create(model=model_id, messages=messages, max_tokens=12, temperature=0)
        return response.choices[0].message.content

    as_string = reply([{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello\nthere"}])
    parts = [{"type": "text", "text": "Hello"}, {"type": "text", "text": "there"}]
    as_parts = reply([{"role": "developer", "content": [{"type": "text", "text": "Be brief."}]},
                      {"role": "user", "content": parts}])
    assert as_parts == as_string


def test_max_tokens_ends_with_length(client: openai.OpenAI, model_id: str) -> None:
    for kwargs in ({"max_tokens": 3}, {"max_completion_tokens": 3}):
        response = chat(client, model_id, "Hello!", temperature=0, **kwargs)
        assert response.choices[0].finish_reason == "length"
        assert response.usage.completion_tokens == 3


def test_seed_reproduces_sampling(client: openai.OpenAI, model_id: str) -> None:
    def sample(seed: int) -> str:
        response = chat(client, model_id, "Tell me a story.", max_tokens=20, temperature=1.5, seed=seed)
        return response.choices[0].message.content

    assert sample(7) == sample(7)
    assert len({sample(seed) for seed in (1, 2, 3, 4)}) > 1


def test_top_k_1_and_tiny_top_p_are_greedy(client: openai.OpenAI, oracle: Oracle, model_id: str) -> None:
    greedy = oracle.expected(oracle.chat_ids("Write code."), 20)[0]
    top_k = chat(client, model_id, "Write code.", max_tokens=20, temperature=1.0, seed=3, extra_body={"top_k": 1})
    top_p = chat(client, model_id, "Write code.", max_tokens=20, temperature=1.0, seed=3, top_p=1e-9)
    assert top_k.choices[0].message.content == top_p.choices[0].message.content == greedy


def test_eos_from_generation_config_ends_with_stop(checkpoint: Path, tmp_path: Path) -> None:  # noqa: F811
    """Make a token the model emits greedily an EOS id (generation_config.json), and compare with transformers."""
    model_dir = tmp_path / "eos-model"
    shutil.copytree(checkpoint, model_dir)
    oracle = Oracle(checkpoint)
    prompt_ids = oracle.chat_ids("Hello!")
    tokens = oracle.generate(prompt_ids, MAX_TOKENS)
    position = next(i for i in range(3, len(tokens)) if tokens[i] not in tokens[:i])
    config = json.loads((model_dir / "generation_config.json").read_text())
    config["eos_token_id"] = [*config["eos_token_id"], tokens[position]]
    (model_dir / "generation_config.json").write_text(json.dumps(config))
    eos_oracle = Oracle(model_dir)
    text, finish, count = eos_oracle.expected(prompt_ids, MAX_TOKENS)
    assert (finish, count) == ("stop", position + 1)

    process = start_node(tmp_path / "home", str(model_dir), "--dtype", "float32")
    try:
        client = openai.OpenAI(base_url=process.base_url + "/v1", api_key="unused", max_retries=0)
        response = chat(client, "eos-model", "Hello!", max_tokens=MAX_TOKENS, temperature=0)
        assert response.choices[0].message.content == text
        assert response.choices[0].finish_reason == "stop"
        assert response.usage.completion_tokens == count
        chunks, streamed = _stream_chat(client, "eos-model", "Hello!", max_tokens=MAX_TOKENS, temperature=0)
        assert streamed == text
        assert chunks[-1].choices[0].finish_reason == "stop"
    finally:
        assert process.stop() == 0, process.log()


def test_the_client_sees_typed_errors(client: openai.OpenAI, model_id: str) -> None:
    with pytest.raises(openai.BadRequestError) as bad:
        chat(client, model_id, "Hello!", temperature=3)
    assert bad.value.status_code == 400 and bad.value.param == "temperature"
    with pytest.raises(openai.NotFoundError) as missing:
        chat(client, "no-such-model", "Hello!")
    assert missing.value.code == "model_not_found"
