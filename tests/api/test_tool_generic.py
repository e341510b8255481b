"""The generic tool format (exo_like/api/tool_calls/generic.py), for templates that cannot show tools: its parser on
scripted answers, fed whole and in every kind of piece (the same content and calls come out); its grammars walked
with random allowed tokens of the test tokenizer (forced: calls that fit the schemas, one for a named tool; auto:
plain text or a call, never a malformed call); the system message and the conversation a template without tools
gets."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest

from exo_like.api.tool_calls import Tool, ToolCall
from exo_like.api.tool_calls.detect import detect
from exo_like.api.tool_calls.generic import GENERIC, prompt_messages, tools_text
from exo_like.models.demo import CHAT_TEMPLATE
from tests.api.test_tool_formats import (NOW, SEARCH, WEATHER, Vocabulary, assert_fit, chunkings, forced_calls,
                                         random_pieces, run, summary)

PARIS = ("get_weather", {"city": "Paris"})
UTC = ("get_time", {"tz": "UTC"})
ONE = '{"tool_call": {"name": "get_weather", "arguments": {"city": "Paris"}}}'
TWO = '{"tool_calls": [{"name": "get_weather", "arguments": {"city": "Paris"}}, {"name": "get_time", "arguments": ' \
      '{"tz": "UTC"}}]}'

# (id, model output, expected content, expected calls)
CASES: list[tuple[str, str, str, list[tuple[str, dict]]]] = [
    ("plain", "Hello there.\n", "Hello there.\n", []),
    ("one call", ONE, "", [PARIS]),
    ("leading whitespace", "\n  " + ONE + "\n", "", [PARIS]),
    ("several calls", TWO, "", [PARIS, UTC]),
    ("objects one after the other", ONE + '\n{"tool_call": {"name": "get_time", "arguments": {"tz": "UTC"}}}', "",
     [PARIS, UTC]),
    ("arguments as text, none, unicode", '{"tool_calls": [{"name": "now"}, {"name": "say", "arguments": '
     '"{\\"t\\": \\"café 🙂\\"}"}]}', "", [("now", {}), ("say", {"t": "café 🙂"})]),
    ("text after a call", ONE + "\nDone. \n", "\nDone.", [PARIS]),
    ("json answer", ' {"answer": 42, "tool_call": 7}', ' {"answer": 42, "tool_call": 7}', []),
    ("extra key", '{"tool_call": {"name": "a", "arguments": {}}, "id": "x"}',
     '{"tool_call": {"name": "a", "arguments": {}}, "id": "x"}', []),
    ("empty list", '{"tool_calls": []} ok', '{"tool_calls": []} ok', []),
    ("one bad call spoils the list", '{"tool_calls": [{"name": "a"}, {"arguments": {}}]}',
     '{"tool_calls": [{"name": "a"}, {"arguments": {}}]}', []),
    ("invalid json", '{"tool_call": {"name": "a", "arguments": {"x": }}} end',
     '{"tool_call": {"name": "a", "arguments": {"x": }}} end', []),
    ("cut short", '{"tool_call": {"name": "get_weather", "arguments": {"city": "Par',
     '{"tool_call": {"name": "get_weather", "arguments": {"city": "Par', []),
    ("call after text is text", 'Sure: ' + ONE, 'Sure: ' + ONE, []),
    ("braces in strings", '{"tool_call": {"name": "say", "arguments": {"t": "}{]\\"["}}}', "",
     [("say", {"t": '}{]"['})]),
]


@pytest.mark.parametrize("case", CASES, ids=[case[0] for case in CASES])
def test_outputs_parse_the_same_in_any_pieces(case: tuple) -> None:
    _, text, content, calls = case
    for pieces in chunkings(text):
        assert summary(run(GENERIC, pieces)) == (content, calls), pieces


def test_random_soup_parses_the_same_in_any_pieces_and_loses_nothing() -> None:
    fragments = [ONE, TWO, "{", "}", '"', "\\", "[", "]", " ", "\n", "hi", '{"tool_call": ', '{"name": "a"}',
                 '{"tool_calls": [', '"arguments": {}']
    rng = random.Random(7)
    for _ in range(400):
        text = "".join(rng.choice(fragments) for _ in range(rng.randint(1, 10)))
        content, calls = summary(run(GENERIC, [text]))
        for pieces in (list(text), random_pieces(text, len(text))):
            assert summary(run(GENERIC, pieces)) == (content, calls), text
        if not calls:
            assert content == text


def test_plain_text_streams_at_once() -> None:
    parser = GENERIC.parser()
    assert parser.feed("  ") == []  # an answer's leading whitespace waits: a call's "{" may follow
    assert parser.feed("It is") == ["  It is"]
    assert parser.feed(" {sunny}") == [" {sunny}"]
    assert parser.flush() == []


def test_a_call_comes_whole_with_an_openai_id() -> None:
    parser = GENERIC.parser()
    assert parser.feed(ONE[:-1]) == []
    [call] = parser.feed(ONE[-1:])
    assert isinstance(call, ToolCall) and call.id.startswith("call_")
    assert (call.name, call.arguments) == ("get_weather", '{"city": "Paris"}')


def test_detect_leaves_templates_without_tools_to_the_caller() -> None:
    """detect() names only a model's own format; the generic one is chat.py's fallback."""
    assert detect("llama", CHAT_TEMPLATE) is None
    assert GENERIC.name == "generic" and GENERIC.markers == () and GENERIC.skip_special_tokens


@pytest.fixture(scope="module")
def vocabulary() -> Vocabulary:
    return Vocabulary()


@pytest.mark.parametrize("tool", [WEATHER, SEARCH, NOW], ids=lambda tool: tool.name)
def test_forced_grammar_gives_one_call_of_the_tool(vocabulary: Vocabulary, tool) -> None:  # noqa: ANN001
    for seed in range(3):
        _, calls = forced_calls(vocabulary, GENERIC, [tool], None, parallel=False, seed=seed)
        assert [call.name for call in calls] == [tool.name]
        assert_fit(calls, [tool])


def test_forced_grammar_named_tool_is_one_call_of_it(vocabulary: Vocabulary) -> None:
    for name in ("get_weather", "search"):
        for seed in range(3):
            tokens, calls = forced_calls(vocabulary, GENERIC, [WEATHER, SEARCH], name, parallel=False, seed=seed)
            assert [call.name for call in calls] == [name]
            assert vocabulary.tokenizer.decode(tokens).startswith('{"tool_call": ')
            assert_fit(calls, [WEATHER, SEARCH])


def test_forced_grammar_parallel_calls_any_tool(vocabulary: Vocabulary) -> None:
    counts = []
    for seed in range(8):
        _, calls = forced_calls(vocabulary, GENERIC, [WEATHER, SEARCH], None, parallel=True, seed=seed)
        assert calls and {call.name for call in calls} <= {"get_weather", "search"}
        assert_fit(calls, [WEATHER, SEARCH])
        counts.append(len(calls))
    assert max(counts) > 1


def grammar_accepts(vocabulary: Vocabulary, grammar: str, text: str) -> bool:
    """Whether `grammar` takes the tokens of `text` and may end after them."""
    matcher = vocabulary.llguidance.LLMatcher(vocabulary.ll_tokenizer, vocabulary.compile(grammar), log_level=0)
    tokens = vocabulary.tokenizer.encode(text, add_special_tokens=False).ids
    return all(matcher.consume_token(token) for token in tokens) and matcher.is_accepting()


@pytest.mark.parametrize("parallel", [True, False])
def test_auto_grammar_walks_give_text_or_valid_calls(vocabulary: Vocabulary, parallel: bool) -> None:
    """Free walks (almost never starting with "{": few tokens can) are text; walks that start a call with "{" are
    calls that fit, one only unless parallel calls are allowed."""
    grammar = vocabulary.compile(GENERIC.auto_grammar([WEATHER, SEARCH], parallel))
    brace = vocabulary.tokenizer.token_to_id("{")
    counts = []
    for seed in range(8):
        text = vocabulary.tokenizer.decode(vocabulary.walk(grammar, seed, cap=100, done=False))
        if not text.lstrip().startswith("{"):
            assert summary(run(GENERIC, [text])) == (text, []) and text
        text = vocabulary.tokenizer.decode(vocabulary.walk(grammar, seed, cap=2000, prefix=[brace]))
        events = run(GENERIC, [text])
        calls = [event for event in events if isinstance(event, ToolCall)]
        assert calls and len(calls) == len(events), text
        assert_fit(calls, [WEATHER, SEARCH])
        counts.append(len(calls))
    assert max(counts) > 1 if parallel else max(counts) == 1


def test_auto_grammar_keeps_plain_answers_and_refuses_malformed_calls(vocabulary: Vocabulary) -> None:
    grammar = GENERIC.auto_grammar([WEATHER, SEARCH], parallel=False)
    assert grammar_accepts(vocabulary, grammar, "It is sunny in Paris, {probably}.\n")
    assert grammar_accepts(vocabulary, grammar, "")
    search = '{"tool_call": {"name": "search", "arguments": {"query": "x", "limit": 3}}}'
    assert grammar_accepts(vocabulary, grammar, search)
    assert not grammar_accepts(vocabulary, grammar, '{"tool_call": {"name": "nope", "arguments": {}}}')
    assert not grammar_accepts(vocabulary, grammar, ' {"answer": 1}')
    assert not grammar_accepts(vocabulary, grammar, TWO.replace("get_time", "search"))  # one call at most
    assert grammar_accepts(vocabulary, GENERIC.auto_grammar([WEATHER, SEARCH], parallel=True),
                           '{"tool_calls": [{"name": "search", "arguments": {"query": "x", "limit": 3}}]}')


def test_tools_go_first_in_the_system_message() -> None:
    tools = [WEATHER, NOW]
    offer = tools_text(tools, parallel=True)
    listed = json.loads(offer.splitlines()[1])
    assert [tool["name"] for tool in listed] == ["get_weather", "now"] and listed[1]["description"] == ""
    assert listed[0]["parameters"] == WEATHER.parameters
    assert '{"tool_calls": [' in offer and '{"tool_calls": [' not in tools_text(tools, parallel=False)
    ask = {"role": "user", "content": "Weather?"}
    assert prompt_messages([ask], tools, True) == [{"role": "system", "content": offer}, ask]
    system = {"role": "system", "content": "Be brief."}
    assert prompt_messages([system, ask], tools, True) == [{"role": "system", "content": offer + "\n\nBe brief."},
                                                           ask]
    assert prompt_messages([system, ask], (), True) == [system, ask]  # tool_choice none: no tools described


def test_earlier_calls_and_results_become_text() -> None:
    call = {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}
    other = {"id": "call_2", "type": "function", "function": {"name": "now", "arguments": {}}}
    conversation = [{"role": "user", "content": "Weather?"},
                    {"role": "assistant", "content": "", "tool_calls": [call]},
                    {"role": "tool", "tool_call_id": "call_1", "name": "get_weather", "content": "21 C"},
                    {"role": "assistant", "content": "Checking.", "tool_calls": [call, other]},
                    {"role": "tool", "tool_call_id": "call_1", "name": "get_weather", "content": "21 C"},
                    {"role": "tool", "tool_call_id": "call_2", "name": "now", "content": "noon"}]
    result_1 = '{"tool_result": {"id": "call_1", "name": "get_weather", "content": "21 C"}}'
    assert prompt_messages(conversation, (), True) == [
        conversation[0],
        {"role": "assistant", "content": ONE},
        {"role": "user", "content": result_1},
        {"role": "assistant", "content": "Checking.\n" + TWO.replace('"get_time", "arguments": {"tz": "UTC"}',
                                                                     '"now", "arguments": {}')},
        {"role": "user", "content": result_1 + '\n{"tool_result": {"id": "call_2", "name": "now", "content": "noon"}}'},
    ]
    assert summary(run(GENERIC, [prompt_messages(conversation, (), True)[1]["content"]])) == ("", [PARIS])


def test_docs_give_the_system_message_exactly() -> None:
    docs = (Path(__file__).parents[2] / "docs" / "api.md").read_text()
    section = docs[docs.index("### Tools on models without a tool template"):]
    shown = section[section.index("```\n") + 4:section.index("\n```", section.index("```\n") + 4)].splitlines()
    weather = Tool("get_weather", "The weather in a city.", {"type": "object"})
    written = tools_text([weather], parallel=True).splitlines()
    # (The tools' line in the docs elides the schema.)
    assert shown[1] == written[1].replace('{"type": "object"}', "{...}")
    assert shown[:1] + shown[2:] == written[:1] + written[2:]
