"""Tool-call formats (exo_like/api/tool_calls): each format's parser on scripted model outputs, fed whole and in
every kind of piece (the same content and calls come out); detect() on chat templates that mention each format's
markers the way the real ones do; and each format's forced grammar, walked with random allowed tokens of the test
tokenizer (llguidance), whose text the format's own parser must turn into calls that fit the tool's schema."""

from __future__ import annotations

import json
import random
import re
from collections.abc import Sequence

import numpy as np
import pytest

from exo_like.api.tool_calls import Event, Tool, ToolCall, ToolFormat
from exo_like.api.tool_calls import deepseek, harmony, hermes, llama3, mistral
from exo_like.api.tool_calls.detect import detect
from exo_like.models.demo import CHAT_TEMPLATE, EOT, build_tokenizer
from exo_like.models.tokenizer import compile_chat_template
from tests.chat_templates import HERMES_TOOLS_TEMPLATE

PARIS = ("get_weather", {"city": "Paris"})
UTC = ("get_time", {"tz": "UTC"})

INVALID_DEEPSEEK = ('x<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>get_weather<｜tool▁sep｜>{"city": <｜tool▁call▁end｜>'
                    '<｜tool▁calls▁end｜>')

# (id, format, model output, expected content, expected calls)
CASES: list[tuple[str, ToolFormat, str, str, list[tuple[str, dict]]]] = [
    ("hermes plain", hermes.HERMES, "Hello there.\n", "Hello there.\n", []),
    ("hermes content then call", hermes.HERMES,
     'Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>',
     "Let me check.\n", [PARIS]),
    ("hermes two calls", hermes.HERMES,
     '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n'
     '<tool_call>\n{"name": "get_time", "arguments": "{\\"tz\\": \\"UTC\\"}"}\n</tool_call>\n', "", [PARIS, UTC]),
    ("hermes no arguments, unicode", hermes.HERMES,
     '<tool_call>{"name": "now"}</tool_call><tool_call>{"name": "say", "arguments": {"t": "café 🙂"}}</tool_call>',
     "", [("now", {}), ("say", {"t": "café 🙂"})]),
    ("hermes invalid json", hermes.HERMES,
     'Try <tool_call>\n{"name": "get_weather", "arguments": {"city": }\n</tool_call> end',
     'Try <tool_call>\n{"name": "get_weather", "arguments": {"city": }\n</tool_call> end', []),
    ("hermes no name", hermes.HERMES, '<tool_call>{"arguments": {}}</tool_call>',
     '<tool_call>{"arguments": {}}</tool_call>', []),
    ("hermes mention", hermes.HERMES, "Wrap each call in <tool_call> tags, as in <tool_call></tool_call>.",
     "Wrap each call in <tool_call> tags, as in <tool_call></tool_call>.", []),
    ("hermes text after call", hermes.HERMES,
     '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\nDone. \n',
     "\nDone.", [PARIS]),
    ("hermes end tag cut off", hermes.HERMES, '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n',
     "", [PARIS]),
    ("llama3 plain", llama3.LLAMA3, "The weather is nice.", "The weather is nice.", []),
    ("llama3 call", llama3.LLAMA3, '{"name": "get_weather", "parameters": {"city": "Paris"}}', "", [PARIS]),
    ("llama3 python tag, two calls", llama3.LLAMA3,
     '<|python_tag|>{"name": "get_weather", "parameters": {"city": "Paris"}}; '
     '{"name": "get_time", "arguments": "{\\"tz\\": \\"UTC\\"}"};\n', "", [PARIS, UTC]),
    ("llama3 content then tag", llama3.LLAMA3,
     'Let me look.<|python_tag|>{"name": "get_weather", "parameters": {"city": "Paris"}}', "Let me look.", [PARIS]),
    ("llama3 leading whitespace", llama3.LLAMA3, '\n\n {"name": "get_time", "parameters": {"tz": "UTC"}}', "", [UTC]),
    ("llama3 json answer", llama3.LLAMA3, ' {"answer": 42, "name": 7}', ' {"answer": 42, "name": 7}', []),
    ("llama3 invalid json", llama3.LLAMA3, '{"name": "get_weather", "parameters": {"city": "Paris"}',
     '{"name": "get_weather", "parameters": {"city": "Paris"}', []),
    ("llama3 mention", llama3.LLAMA3, 'Call tools as {"name": ..., "parameters": ...}.',
     'Call tools as {"name": ..., "parameters": ...}.', []),
    ("mistral list", mistral.JSON_LIST,
     '[TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": "Paris"}}, '
     '{"name": "get_time", "arguments": {"tz": "UTC"}, "id": "abcDEF123"}]', "", [PARIS, UTC]),
    ("mistral content then list", mistral.JSON_LIST,
     'Sure.[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris"}}]', "Sure.", [PARIS]),
    ("mistral name args", mistral.NAME_ARGS,
     '[TOOL_CALLS]get_weather[ARGS]{"city": "Paris"}[TOOL_CALLS]get_time[ARGS]{"tz": "UTC"}', "", [PARIS, UTC]),
    ("mistral call id", mistral.NAME_ARGS,
     'Checking.[TOOL_CALLS]get_weather[CALL_ID]abcDEF123[ARGS]{"city": "Zürich"}',
     "Checking.", [("get_weather", {"city": "Zürich"})]),
    ("mistral space before arguments", mistral.NAME_ARGS, '[TOOL_CALLS]get_weather[ARGS] {"city": "Paris"}', "",
     [PARIS]),
    ("mistral args marker skipped", mistral.NAME_ARGS, '[TOOL_CALLS]get_weather{"city": "Paris"}', "", [PARIS]),
    ("mistral invalid json", mistral.JSON_LIST, '[TOOL_CALLS][{"name": "a", "arguments": {"x": }}] ok',
     '[TOOL_CALLS][{"name": "a", "arguments": {"x": }}] ok', []),
    ("mistral no name", mistral.JSON_LIST, '[TOOL_CALLS][{"arguments": {}}]', '[TOOL_CALLS][{"arguments": {}}]', []),
    ("mistral mention", mistral.NAME_ARGS, "The [TOOL_CALLS] token starts calls.",
     "The [TOOL_CALLS] token starts calls.", []),
    ("deepseek v3 two calls", deepseek.V3,
     "Let me check.<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>get_weather\n```json\n"
     '{"city": "Paris"}\n```<｜tool▁call▁end｜>\n<｜tool▁call▁begin｜>function<｜tool▁sep｜>get_time\n```json\n'
     '{"tz": "UTC"}\n```<｜tool▁call▁end｜><｜tool▁calls▁end｜>', "Let me check.", [PARIS, UTC]),
    ("deepseek v3.1", deepseek.V3_1,
     '<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>get_weather<｜tool▁sep｜>{"city": "Paris"}<｜tool▁call▁end｜>'
     '<｜tool▁call▁begin｜>get_time<｜tool▁sep｜>{"tz": "UTC"}<｜tool▁call▁end｜><｜tool▁calls▁end｜>',
     "", [PARIS, UTC]),
    ("deepseek invalid json", deepseek.V3_1, INVALID_DEEPSEEK, INVALID_DEEPSEEK, []),
    ("deepseek one invalid call of two", deepseek.V3_1,
     '<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>get_weather<｜tool▁sep｜>{"city": "Paris"}<｜tool▁call▁end｜>'
     '<｜tool▁call▁begin｜>get_time<｜tool▁sep｜>{"tz": <｜tool▁call▁end｜><｜tool▁calls▁end｜>',
     '<｜tool▁call▁begin｜>get_time<｜tool▁sep｜>{"tz": <｜tool▁call▁end｜>', [PARIS]),
    ("deepseek mention", deepseek.V3, "The marker <｜tool▁calls▁begin｜> opens calls.",
     "The marker <｜tool▁calls▁begin｜> opens calls.", []),
    ("harmony call", harmony.HARMONY,
     "<|channel|>analysis<|message|>Need the weather.<|end|><|start|>assistant<|channel|>commentary "
     'to=functions.get_weather <|constrain|>json<|message|>{"city":"Paris"}<|call|>', "", [PARIS]),
    ("harmony call, stop token stripped", harmony.HARMONY,
     '<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>{"city":"Paris"}', "", [PARIS]),
    ("harmony recipient in role", harmony.HARMONY,
     "<|channel|>analysis<|message|>Time.<|end|><|start|>assistant to=functions.get_time<|channel|>commentary json"
     '<|message|>{"tz": "UTC"}<|call|>', "", [UTC]),
    ("harmony recipient first", harmony.HARMONY,
     ' to=functions.get_time<|channel|>commentary json<|message|>{"tz": "UTC"}', "", [UTC]),
    ("harmony two calls after a preamble", harmony.HARMONY,
     "<|channel|>commentary<|message|>Checking both.<|end|><|start|>assistant<|channel|>commentary "
     'to=functions.get_weather<|constrain|>json<|message|>{"city":"Paris"}<|call|><|start|>assistant<|channel|>'
     'commentary to=functions.get_time <|constrain|>json<|message|>{"tz":"UTC"}<|call|>', "", [PARIS, UTC]),
    ("harmony final", harmony.HARMONY,
     "<|channel|>analysis<|message|>Simple.<|end|><|start|>assistant<|channel|>final<|message|>2 + 2 = 4.<|return|>",
     "2 + 2 = 4.", []),
    ("harmony final cut", harmony.HARMONY, "<|channel|>final<|message|>Use to=functions.x <|con",
     "Use to=functions.x <|con", []),
    ("harmony built-in tool", harmony.HARMONY,
     '<|channel|>analysis to=browser.search code<|message|>{"query": "x"}<|call|>', "", []),
    ("harmony invalid json", harmony.HARMONY,
     '<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>{"city": <|call|>', '{"city": ', []),
    ("harmony plain text", harmony.HARMONY, "Hello <b>there</b>.", "Hello <b>there</b>.", []),
]


def run(tool_format: ToolFormat, pieces: Sequence[str]) -> list[Event]:
    parser = tool_format.parser()
    events = [event for piece in pieces for event in parser.feed(piece)]
    return events + parser.flush()


def summary(events: list[Event]) -> tuple[str, list[tuple[str, dict]]]:
    assert all(event for event in events if isinstance(event, str)), "no empty content deltas"
    content = "".join(event for event in events if isinstance(event, str))
    calls = [(event.name, json.loads(event.arguments)) for event in events if isinstance(event, ToolCall)]
    return content, calls


def random_pieces(text: str, seed: int) -> list[str]:
    rng, pieces, i = random.Random(seed), [], 0
    while i < len(text):
        size = rng.randint(1, 3)
        pieces.append(text[i:i + size])
        i += size
    return pieces


def chunkings(text: str) -> list[list[str]]:
    """The text whole, one character at a time, cut in two at every boundary, and in random 1..3-char pieces."""
    halves = [[text[:i], text[i:]] for i in range(1, len(text))]
    return [[text], list(text), *halves, *(random_pieces(text, seed) for seed in range(4))]


@pytest.mark.parametrize("case", CASES, ids=[case[0] for case in CASES])
def test_outputs_parse_the_same_in_any_pieces(case: tuple) -> None:
    _, tool_format, text, content, calls = case
    for pieces in chunkings(text):
        assert summary(run(tool_format, pieces)) == (content, calls), pieces


@pytest.mark.parametrize("case", CASES, ids=[case[0] for case in CASES])
def test_calls_carry_openai_ids_and_object_arguments(case: tuple) -> None:
    events = run(case[1], [case[2]])
    calls = [event for event in events if isinstance(event, ToolCall)]
    assert len({call.id for call in calls}) == len(calls)
    for call in calls:
        assert re.fullmatch(r"call_[0-9a-f]{24}", call.id)
        assert isinstance(json.loads(call.arguments), dict)
        assert call.arguments == json.dumps(json.loads(call.arguments), ensure_ascii=False)


# Pieces of each format's text, markers cut short and JSON that is and is not a call among them.
SOUPS: dict[str, tuple[ToolFormat, list[str]]] = {
    "hermes": (hermes.HERMES, ["<tool_call>", "</tool_call>", "<tool", "\n", " ", "hi", "{", "}", '"', "\\",
                               '{"name": "a", "arguments": {"x": 1}}', '{"name": "b"}']),
    "llama3": (llama3.LLAMA3, ["<|python_tag|>", "<|py", ";", " ", "\n", "hi", "{", "}", '"',
                               '{"name": "a", "parameters": {"x": 1}}', '{"a": 1}']),
    "mistral": (mistral.NAME_ARGS, ["[TOOL_CALLS]", "[ARGS]", "[CALL_ID]", "[TOOL", "abc", " ", "get", "[", "]", "{",
                                    "}", '"', '{"x": 1}', '[{"name": "a", "arguments": {}}]', "hi there"]),
    "deepseek": (deepseek.V3, [deepseek.CALLS_BEGIN, deepseek.CALLS_END, deepseek.CALL_BEGIN, deepseek.CALL_END,
                               deepseek.SEP, "<｜tool", "function", "get", "\n```json\n", "\n```", '{"x": 1}', " ",
                               "\n", "hi", f'{deepseek.CALL_BEGIN}get{deepseek.SEP}{{"x": 1}}{deepseek.CALL_END}']),
    "harmony": (harmony.HARMONY, ["<|start|>", "assistant", "<|channel|>", "analysis", "final", "commentary", "hello",
                                  " to=functions.f", " to=browser.x", " <|constrain|>json", "<|message|>", '{"x":1}',
                                  "<|end|>", "<|call|>", "<|return|>", " ", "\n", "<|",
                                  '<|start|>assistant<|channel|>commentary to=functions.f json<|message|>{}<|call|>']),
}


@pytest.mark.parametrize("soup", SOUPS, ids=list(SOUPS))
def test_random_marker_soup_parses_the_same_in_any_pieces(soup: str) -> None:
    tool_format, fragments = SOUPS[soup]
    rng = random.Random(soup)
    for _ in range(400):
        text = "".join(rng.choice(fragments) for _ in range(rng.randint(1, 12)))
        content, calls = summary(run(tool_format, [text]))
        for pieces in (list(text), random_pieces(text, len(text))):
            assert summary(run(tool_format, pieces)) == (content, calls), text
        if not calls and tool_format is not harmony.HARMONY:  # harmony drops what is not final or a call
            assert content == text  # nothing lost


@pytest.mark.parametrize("tool_format, before, marker_prefix", [
    (hermes.HERMES, "Let me check. ", "<tool"),
    (llama3.LLAMA3, "Let me check. ", "<|python"),
    (mistral.NAME_ARGS, "Let me check. ", "[TOOL_"),
    (deepseek.V3, "Let me check. ", "<｜tool▁call"),
])
def test_content_streams_before_a_marker_prefix(tool_format: ToolFormat, before: str, marker_prefix: str) -> None:
    parser = tool_format.parser()
    assert parser.feed(before + marker_prefix) == [before]  # only the possible marker is held
    assert parser.flush() == [marker_prefix]


def test_harmony_final_content_streams() -> None:
    parser = harmony.HARMONY.parser()
    assert parser.feed("<|channel|>analysis<|message|>hidden<|end|><|start|>assistant<|channel|>final<|message|>") == []
    assert parser.feed("It is sunny<|") == ["It is sunny"]
    assert parser.feed("return|>") == []
    assert parser.flush() == []


# --- detect -----------------------------------------------------------------------------------------------------

QWEN25_LIKE = (
    "{% if tools %}<|im_start|>system\n# Tools\n\n<tools>{% for tool in tools %}\n{{ tool | tojson }}{% endfor %}"
    "\n</tools>\n\nReturn each call within <tool_call></tool_call> XML tags.<|im_end|>\n{% endif %}"
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n{% endfor %}"
)
LLAMA31_LIKE = (
    "{% if tools is not none %}<|start_header_id|>system<|end_header_id|>\n\nEnvironment: ipython\n"
    "{{ tools | tojson }}<|eot_id|>{% endif %}"
    "{% for message in messages %}{% if message['tool_calls'] is defined %}"
    "{% if builtin %}<|python_tag|>{% endif %}"
    '{{ \'{"name": "\' + message[\'tool_calls\'][0][\'function\'][\'name\'] + \'", "parameters": \' }}'
    "{% endif %}{% endfor %}"
)
LLAMA32_LIKE = "{% if tools %}Environment: ipython\n{{ tools | tojson }}{% endif %}{{ messages[0]['content'] }}"
MISTRAL_V3_LIKE = (
    "{% for message in messages %}{% if tools and loop.last %}[AVAILABLE_TOOLS] {{ tools | tojson }}"
    "[/AVAILABLE_TOOLS]{% endif %}[INST] {{ message['content'] }}[/INST]"
    "{% if message['tool_calls'] is defined %}{{ '[TOOL_CALLS] [' }}{% endif %}{% endfor %}"
)
MISTRAL_V13_LIKE = (
    "[AVAILABLE_TOOLS]{{ tools | tojson }}[/AVAILABLE_TOOLS]{% for message in messages %}"
    "{% for call in message['tool_calls'] or [] %}{{ '[TOOL_CALLS]' + call['function']['name'] + '[ARGS]' }}"
    "{% endfor %}{% endfor %}"
)
DEEPSEEK_V3_LIKE = (
    "{% if tools %}## Tools\n{{ tools | tojson }}{% endif %}{% for message in messages %}"
    "{% for tool in message['tool_calls'] or [] %}{{ '<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>' + tool['type'] + "
    "'<｜tool▁sep｜>' + tool['function']['name'] + '\\n```json\\n' + tool['function']['arguments'] + '\\n```' }}"
    "{% endfor %}{% endfor %}"
)
DEEPSEEK_V31_LIKE = (
    "{% if tools %}## Tools\n{{ tools | tojson }}{% endif %}{% for message in messages %}"
    "{% for tool in message['tool_calls'] or [] %}{{ '<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>' + "
    "tool['function']['name'] + '<｜tool▁sep｜>' + tool['function']['arguments'] + '<｜tool▁call▁end｜>' }}"
    "{% endfor %}{% endfor %}"
)
GPT_OSS_LIKE = (
    "{% if tools %}<|start|>developer<|message|># Tools\n{{ tools | tojson }}<|end|>{% endif %}"
    "{% for message in messages %}<|start|>{{ message['role'] }}<|channel|>final<|message|>"
    "{{ message['content'] }}<|end|>{% endfor %}"
)
TOOLS_NO_MARKERS = "{% if tools %}Functions: {{ tools | tojson }}\n{% endif %}{{ messages[0]['content'] }}"


@pytest.mark.parametrize("model_type, template, expected", [
    ("qwen2", QWEN25_LIKE, hermes.HERMES),
    ("llama", HERMES_TOOLS_TEMPLATE, hermes.HERMES),
    ("llama", LLAMA31_LIKE, llama3.LLAMA3),
    ("llama", LLAMA32_LIKE, llama3.LLAMA3),
    ("mistral", MISTRAL_V3_LIKE, mistral.JSON_LIST),
    ("mistral", MISTRAL_V13_LIKE, mistral.NAME_ARGS),
    ("deepseek_v3", DEEPSEEK_V3_LIKE, deepseek.V3),
    ("deepseek_v3", DEEPSEEK_V31_LIKE, deepseek.V3_1),
    ("gpt_oss", None, harmony.HARMONY),
    ("gpt_oss", CHAT_TEMPLATE, harmony.HARMONY),
    ("unknown", GPT_OSS_LIKE, harmony.HARMONY),
    ("llama", TOOLS_NO_MARKERS, hermes.HERMES),
    ("llama", CHAT_TEMPLATE, None),
    ("llama", None, None),
    ("llama", "{{ messages[0]['content'] }} <tool_call>", None),
])
def test_detect(model_type: str, template: str | None, expected: ToolFormat | None) -> None:
    if template is not None:
        compile_chat_template(template)  # the sample templates are real Jinja
    assert detect(model_type, template) == expected


def test_format_names() -> None:
    formats = [hermes.HERMES, llama3.LLAMA3, mistral.JSON_LIST, mistral.NAME_ARGS, deepseek.V3, deepseek.V3_1,
               harmony.HARMONY]
    assert [f.name for f in formats] == ["hermes", "llama3_json", "mistral", "mistral", "deepseek_v3", "deepseek_v3",
                                         "harmony"]
    assert [f.skip_special_tokens for f in formats] == [True, True, False, False, False, False, False]


# --- the test checkpoints' tools template ---------------------------------------------------------------------

WEATHER_TOOL = {"type": "function", "function": {
    "name": "get_weather", "description": "Weather <now> in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
CONVERSATION = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "Weather in Paris and Rome?"},
    {"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}},
        {"id": "call_2", "type": "function", "function": {"name": "get_weather", "arguments": {"city": "Rome"}}}]},
    {"role": "tool", "tool_call_id": "call_1", "content": "sunny"},
    {"role": "tool", "tool_call_id": "call_2", "content": "rain"},
    {"role": "assistant", "content": "Sunny in Paris, rain in Rome."},
]


def render_hermes(messages: list[dict], tools: list[dict] | None) -> str:
    return compile_chat_template(HERMES_TOOLS_TEMPLATE).render(
        messages=messages, tools=tools, add_generation_prompt=True, bos_token="<|begin_of_text|>")


def test_hermes_tools_template_renders_tools_calls_and_results() -> None:
    prompt = render_hermes(CONVERSATION, [WEATHER_TOOL])
    assert prompt.startswith("<|begin_of_text|><|start_header_id|>system<|end_header_id|>\n\nBe brief.\n\n# Tools")
    assert "<tools>\n" + json.dumps(WEATHER_TOOL, ensure_ascii=False) + "\n</tools>" in prompt
    assistant = prompt.split("<|start_header_id|>assistant<|end_header_id|>\n\n")[1].split(EOT)[0]
    # What the template shows the model is what the parser reads back.
    assert summary(run(hermes.HERMES, [assistant])) == ("", [("get_weather", {"city": "Paris"}),
                                                             ("get_weather", {"city": "Rome"})])
    assert ("<|start_header_id|>user<|end_header_id|>\n\n<tool_response>\nsunny\n</tool_response>\n"
            "<tool_response>\nrain\n</tool_response><|eot_id|>") in prompt
    assert prompt.endswith("Sunny in Paris, rain in Rome.<|eot_id|><|start_header_id|>assistant<|end_header_id|>\n\n")


def test_hermes_tools_template_without_tools_is_the_plain_chat() -> None:
    messages = [{"role": "user", "content": "Hi"}]
    plain = compile_chat_template(CHAT_TEMPLATE).render(messages=messages, add_generation_prompt=True,
                                                        bos_token="<|begin_of_text|>")
    assert render_hermes(messages, None) == plain


def test_hermes_tools_template_renders_as_transformers_does() -> None:
    transformers = pytest.importorskip("transformers")
    tokenizer = transformers.PreTrainedTokenizerFast(tokenizer_object=build_tokenizer(),
                                                     bos_token="<|begin_of_text|>", eos_token=EOT)
    tokenizer.chat_template = HERMES_TOOLS_TEMPLATE
    rendered = tokenizer.apply_chat_template(CONVERSATION, tools=[WEATHER_TOOL], add_generation_prompt=True,
                                             tokenize=False)
    assert rendered == render_hermes(CONVERSATION, [WEATHER_TOOL])


# --- forced grammars --------------------------------------------------------------------------------------------

WEATHER = Tool("get_weather", "Weather in a city", {
    "type": "object", "additionalProperties": False, "required": ["city"],
    "properties": {"city": {"type": "string", "maxLength": 12}, "unit": {"enum": ["celsius", "fahrenheit"]}}})
SEARCH = Tool("search", None, {
    "type": "object", "additionalProperties": False, "required": ["query", "limit"],
    "properties": {"query": {"type": "string", "minLength": 1, "maxLength": 10},
                   "limit": {"type": "integer", "minimum": 1, "maximum": 50},
                   "tags": {"type": "array", "items": {"type": "string", "maxLength": 5}, "maxItems": 3},
                   "exact": {"type": "boolean"}}})
NOW = Tool("now", None, {"type": "object", "properties": {}, "additionalProperties": False})
FORMATS = [hermes.HERMES, llama3.LLAMA3, mistral.JSON_LIST, mistral.NAME_ARGS, deepseek.V3, deepseek.V3_1,
           harmony.HARMONY]
FORMAT_IDS = ["hermes", "llama3", "mistral-list", "mistral-args", "deepseek-v3", "deepseek-v3.1", "harmony"]


class Vocabulary:
    """The test tokenizer as llguidance sees it, and a random walk through a grammar's allowed tokens."""

    def __init__(self, added_special: Sequence[str] = ()) -> None:
        self.llguidance = pytest.importorskip("llguidance")
        self.tokenizer = build_tokenizer()
        self.tokenizer.add_special_tokens(list(added_special))
        self.eos = self.tokenizer.token_to_id(EOT)
        self.size = self.tokenizer.get_vocab_size()
        self.ll_tokenizer = self.llguidance.LLTokenizer(self.tokenizer.to_str(), n_vocab=self.size, eos_token=self.eos)

    def compile(self, lark: str) -> str:
        grammar = self.llguidance.LLMatcher.grammar_from_lark(lark)
        assert self.llguidance.LLMatcher.validate_grammar(grammar, self.ll_tokenizer) == ""
        return grammar

    def walk(self, grammar: str, seed: int, cap: int = 400, prefix: Sequence[int] = (),
             done: bool = True) -> list[int]:
        """Tokens picked uniformly among the allowed ones until the grammar is done (EOS excluded), after
        `prefix` (which the grammar must allow); not `done`: `cap` tokens may end the walk before."""
        from llguidance.numpy import allocate_token_bitmask, fill_next_token_bitmask

        matcher = self.llguidance.LLMatcher(self.ll_tokenizer, grammar)
        mask = allocate_token_bitmask(1, self.size)
        rng = np.random.default_rng(seed)
        tokens: list[int] = list(prefix)
        assert all(matcher.consume_token(token) for token in prefix), matcher.get_error()
        while not matcher.is_stopped():
            if len(tokens) >= cap and not done:
                return tokens
            assert len(tokens) < cap, self.tokenizer.decode(tokens, skip_special_tokens=False)
            fill_next_token_bitmask(matcher, mask, 0)
            allowed = np.flatnonzero(np.unpackbits(mask[0].view(np.uint8), bitorder="little")[:self.size])
            if allowed.tolist() == [self.eos]:
                break
            token = int(rng.choice(allowed))
            assert matcher.consume_token(token), matcher.get_error()
            if token == self.eos:
                break
            tokens.append(token)
        assert matcher.is_accepting() and not matcher.get_error()
        return tokens


@pytest.fixture(scope="module")
def vocabulary() -> Vocabulary:
    return Vocabulary()


def forced_calls(vocabulary: Vocabulary, tool_format: ToolFormat, tools: list[Tool], name: str | None,
                 parallel: bool, seed: int, special: dict[str, int] | None = None) -> tuple[list[int], list[ToolCall]]:
    grammar = vocabulary.compile(tool_format.forced_grammar(tools, name, parallel, special=special))
    # Several calls go on until the walk happens to pick EOS between two of them: allow for a few.
    tokens = vocabulary.walk(grammar, seed, cap=2000 if parallel else 400)
    text = vocabulary.tokenizer.decode(tokens, skip_special_tokens=tool_format.skip_special_tokens)
    events = run(tool_format, [text])
    assert not [event for event in events if isinstance(event, str)], text
    return tokens, [event for event in events if isinstance(event, ToolCall)]


def assert_fit(calls: list[ToolCall], tools: list[Tool]) -> None:
    jsonschema = pytest.importorskip("jsonschema")
    schemas = {tool.name: tool.parameters for tool in tools}
    for call in calls:
        jsonschema.validate(json.loads(call.arguments), schemas[call.name])


@pytest.mark.parametrize("tool_format", FORMATS, ids=FORMAT_IDS)
@pytest.mark.parametrize("tool", [WEATHER, SEARCH, NOW], ids=lambda tool: tool.name)
def test_forced_grammar_gives_one_call_of_the_tool(vocabulary: Vocabulary, tool_format: ToolFormat,
                                                   tool: Tool) -> None:
    for seed in range(3):
        _, calls = forced_calls(vocabulary, tool_format, [tool], None, parallel=False, seed=seed)
        assert [call.name for call in calls] == [tool.name]
        assert_fit(calls, [tool])


@pytest.mark.parametrize("tool_format", FORMATS, ids=FORMAT_IDS)
def test_forced_grammar_parallel_calls_any_tool(vocabulary: Vocabulary, tool_format: ToolFormat) -> None:
    tools = [WEATHER, SEARCH]
    counts = []
    for seed in range(8):
        _, calls = forced_calls(vocabulary, tool_format, tools, None, parallel=True, seed=seed)
        assert calls and {call.name for call in calls} <= {"get_weather", "search"}
        assert_fit(calls, tools)
        counts.append(len(calls))
    # gpt-oss stops at <|call|>, so harmony's grammar is one call whatever `parallel` says.
    assert max(counts) == 1 if tool_format is harmony.HARMONY else max(counts) > 1


@pytest.mark.parametrize("tool_format", FORMATS, ids=FORMAT_IDS)
def test_forced_grammar_named_tool_picks_it_among_two(vocabulary: Vocabulary, tool_format: ToolFormat) -> None:
    for name in ("get_weather", "search"):
        for seed in range(3):
            _, calls = forced_calls(vocabulary, tool_format, [WEATHER, SEARCH], name, parallel=False, seed=seed)
            assert [call.name for call in calls] == [name]
            assert_fit(calls, [WEATHER, SEARCH])


def test_forced_grammar_rejects_an_unknown_name() -> None:
    with pytest.raises(ValueError, match="no tool named"):
        hermes.HERMES.forced_grammar([WEATHER], "search", parallel=False)


@pytest.mark.parametrize("tool_format", [mistral.NAME_ARGS, mistral.JSON_LIST, deepseek.V3, harmony.HARMONY],
                         ids=["mistral-args", "mistral-list", "deepseek-v3", "harmony"])
def test_forced_grammar_with_markers_as_special_tokens(tool_format: ToolFormat) -> None:
    vocabulary = Vocabulary(added_special=tool_format.markers)
    special = {text: vocabulary.tokenizer.token_to_id(text) for text in tool_format.markers}
    for seed in range(3):
        tokens, calls = forced_calls(vocabulary, tool_format, [WEATHER, SEARCH], None, parallel=True, seed=seed,
                                     special=special)
        assert calls and set(tokens) & set(special.values())  # the markers went out as their special tokens
        assert_fit(calls, [WEATHER, SEARCH])


def test_a_string_literal_never_matches_a_special_token() -> None:
    """Why `special` exists: llguidance keeps special tokens' bytes apart, so only a token reference matches one."""
    vocabulary = Vocabulary(added_special=["<|call|>"])
    call = vocabulary.tokenizer.token_to_id("<|call|>")
    llguidance = vocabulary.llguidance
    literal = llguidance.LLMatcher(vocabulary.ll_tokenizer, llguidance.LLMatcher.grammar_from_lark('start: "<|call|>"'),
                                   log_level=0)
    assert not literal.consume_token(call)
    reference = llguidance.LLMatcher(vocabulary.ll_tokenizer, llguidance.LLMatcher.grammar_from_lark(
        f"start: <[{call}]>"))
    assert reference.consume_token(call) and reference.is_accepting()
