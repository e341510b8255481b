"""Chat templates for the test checkpoints, beyond the plain one in exo_like/models/demo.py.

HERMES_TOOLS_TEMPLATE renders tools the way Qwen2.5's template does (Hermes-style `<tool_call>` JSON), with the test
tokenizer's Llama-3 turn markers. Written in Hugging Face's conventions: `messages`, `tools` (each a
{"type": "function", "function": {...}} dict), `add_generation_prompt`, `bos_token`, rendered with
trim_blocks/lstrip_blocks (hence `{{ '\\n' }}` where a newline follows a block tag, which would eat a literal one).
"""

from __future__ import annotations

HERMES_TOOLS_TEMPLATE = (
    "{{ bos_token }}"
    "{% if messages and messages[0]['role'] == 'system' %}"
    "{% set system = messages[0]['content'] | trim %}{% set rest = messages[1:] %}"
    "{% else %}"
    "{% set system = '' %}{% set rest = messages %}"
    "{% endif %}"
    # The tools go into the system turn, after the caller's system prompt.
    "{% if tools %}"
    "<|start_header_id|>system<|end_header_id|>\n\n"
    "{% if system %}{{ system + '\\n\\n' }}{% endif %}"
    "# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
    "You are provided with function signatures within <tools></tools> XML tags:\n<tools>"
    "{% for tool in tools %}{{ '\\n' + (tool | tojson) }}{% endfor %}"
    "{{ '\\n' }}</tools>\n\n"
    "For each function call, return a json object with function name and arguments within "
    "<tool_call></tool_call> XML tags:\n<tool_call>\n"
    '{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call><|eot_id|>'
    "{% elif system %}"
    "<|start_header_id|>system<|end_header_id|>\n\n{{ system }}<|eot_id|>"
    "{% endif %}"
    "{% for message in rest %}"
    "{% if message['role'] == 'user' %}"
    "<|start_header_id|>user<|end_header_id|>\n\n{{ message['content'] | trim }}<|eot_id|>"
    "{% elif message['role'] == 'assistant' %}"
    "<|start_header_id|>assistant<|end_header_id|>\n\n{{ (message['content'] or '') | trim }}"
    # Each call a <tool_call> block, a newline before it unless it opens the turn; arguments as given when they are
    # JSON text already, else serialised.
    "{% for call in message['tool_calls'] or [] %}"
    "{% set function = call['function'] if call['function'] is defined else call %}"
    "{% if not loop.first or message['content'] %}{{ '\\n' }}{% endif %}"
    '<tool_call>\n{"name": {{ function[\'name\'] | tojson }}, "arguments": '
    "{% if function['arguments'] is string %}{{ function['arguments'] }}"
    "{% else %}{{ function['arguments'] | tojson }}{% endif %}"
    "}\n</tool_call>"
    "{% endfor %}"
    "<|eot_id|>"
    # Tool results go back in a user turn, consecutive ones together.
    "{% elif message['role'] == 'tool' %}"
    "{% if loop.first or rest[loop.index0 - 1]['role'] != 'tool' %}"
    "<|start_header_id|>user<|end_header_id|>\n\n"
    "{% else %}{{ '\\n' }}{% endif %}"
    "<tool_response>\n{{ message['content'] }}\n</tool_response>"
    "{% if loop.last or rest[loop.index0 + 1]['role'] != 'tool' %}<|eot_id|>{% endif %}"
    "{% else %}"
    "{{ raise_exception('Unknown role: ' + message['role']) }}"
    "{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>\n\n{% endif %}"
)

# Reasoning templates (the test tokenizer's Llama-3 turn markers; <think> and the harmony markers are plain text).
_TURNS = ("{{ bos_token }}{% for message in messages %}"
          "<|start_header_id|>{{ message['role'] }}<|end_header_id|>\n\n"
          "{{ (message['content'] or '').split('</think>')[-1] | trim }}<|eot_id|>{% endfor %}")
# Qwen3's way: the model opens its <think> block itself; enable_thinking=false renders an empty, closed one.
THINK_TEMPLATE = (_TURNS + "{% if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>\n\n"
                  "{% if enable_thinking is defined and not enable_thinking %}<think>\n\n</think>\n\n{% endif %}"
                  "{% endif %}")
# DeepSeek R1's way: the prompt opens the block, the model only closes it.
OPENED_THINK_TEMPLATE = (_TURNS + "{% if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>\n\n"
                         "<think>\n{% endif %}")
# gpt-oss's harmony: the model writes its channels after <|start|>assistant.
HARMONY_TEMPLATE = ("{% for message in messages %}{% if message['role'] == 'assistant' %}"
                    "<|start|>assistant<|channel|>final<|message|>{{ message['content'] }}<|end|>"
                    "{% else %}<|start|>{{ message['role'] }}<|message|>{{ message['content'] }}<|end|>{% endif %}"
                    "{% endfor %}{% if add_generation_prompt %}<|start|>assistant{% endif %}")
