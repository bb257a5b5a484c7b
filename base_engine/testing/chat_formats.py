"""Chat formats of the tiny test checkpoints: Llama 3's special tokens and four chat templates in the
shape of Llama 3.1 instruct, Qwen2.5 (Hermes-style <tool_call> blocks), Qwen3 (Hermes plus the
`enable_thinking` switch) and Mistral v0.3 ([TOOL_CALLS]), each with the tokens its syntax needs.
Used by tiny_tokenizer.py; the templates are our own Jinja, written to the published templates' shape."""

from __future__ import annotations

import dataclasses

BOS_TOKEN = "<|begin_of_text|>"
EOS_TOKEN = "<|eot_id|>"  # end of a chat turn: what an instruct model stops on
END_OF_TEXT_TOKEN = "<|end_of_text|>"  # end of a document: what a base model stops on
START_HEADER_TOKEN = "<|start_header_id|>"
END_HEADER_TOKEN = "<|end_header_id|>"
# Appended after the trained vocabulary, as Llama 3 puts its specials after the BPE ids.
SPECIAL_TOKENS: tuple[str, ...] = (
    BOS_TOKEN,
    END_OF_TEXT_TOKEN,
    START_HEADER_TOKEN,
    END_HEADER_TOKEN,
    EOS_TOKEN,
)

# Llama 3 instruct's template shape: bos, then per message a header and the trimmed content + <|eot_id|>.
# With `tools`, a system turn lists them first and asks for Llama 3.1's JSON calls; assistant calls
# are written back in that JSON and tool results come in `ipython` turns, as Llama 3.1's template does.
CHAT_TEMPLATE = (
    "{{- bos_token }}"
    "{%- if tools %}"
    "{{- '<|start_header_id|>system<|end_header_id|>\\n\\nYou may call these functions. To call one, answer "
    'with JSON in the format {"name": function name, "parameters": dictionary of arguments}.\\n\\n\' }}'
    "{%- for tool in tools %}{{- tool | tojson }}{{- '\\n' }}{%- endfor %}"
    "{{- '<|eot_id|>' }}"
    "{%- endif %}"
    "{%- for message in messages %}"
    "{%- if message['role'] == 'assistant' and message.tool_calls %}"
    "{{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}"
    "{%- for call in message.tool_calls %}"
    "{%- if not loop.first %}{{- '; ' }}{%- endif %}"
    '{{- \'{"name": "\' + call.function.name + \'", "parameters": \' }}'
    "{{- call.function.arguments | tojson }}{{- '}' }}"
    "{%- endfor %}"
    "{{- '<|eot_id|>' }}"
    "{%- elif message['role'] == 'tool' %}"
    "{{- '<|start_header_id|>ipython<|end_header_id|>\\n\\n' }}"
    "{{- message['content'] | trim }}{{- '<|eot_id|>' }}"
    "{%- else %}"
    "{{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n' }}"
    "{{- message['content'] | trim }}{{- '<|eot_id|>' }}"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}"
    "{{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}"
    "{%- endif %}"
)

# Qwen2.5's template shape (ChatML turns; tools in the system turn; calls in <tool_call> blocks; tool
# results as <tool_response> in user turns).
HERMES_TEMPLATE = (
    "{%- if tools %}"
    "{{- '<|im_start|>system\\n' }}"
    "{%- if messages[0]['role'] == 'system' %}{{- messages[0]['content'] + '\\n\\n' }}{%- endif %}"
    "{{- '# Tools\\n\\nYou may call one or more functions to assist with the user query.\\n\\n"
    "You are provided with function signatures within <tools></tools> XML tags:\\n<tools>' }}"
    "{%- for tool in tools %}{{- '\\n' }}{{- tool | tojson }}{%- endfor %}"
    "{{- '\\n</tools>\\n\\nFor each function call, return a json object with function name and arguments "
    'within <tool_call></tool_call> XML tags:\\n<tool_call>\\n{"name": <function-name>, "arguments": '
    "<args-json-object>}\\n</tool_call><|im_end|>\\n' }}"
    "{%- elif messages[0]['role'] == 'system' %}"
    "{{- '<|im_start|>system\\n' + messages[0]['content'] + '<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- for message in messages %}"
    "{%- if message['role'] == 'system' and loop.first %}"
    "{%- elif message['role'] == 'assistant' and message.tool_calls %}"
    "{{- '<|im_start|>assistant' }}"
    "{%- if message['content'] %}{{- '\\n' + message['content'] }}{%- endif %}"
    "{%- for call in message.tool_calls %}"
    '{{- \'\\n<tool_call>\\n{"name": "\' + call.function.name + \'", "arguments": \' }}'
    "{{- call.function.arguments | tojson }}{{- '}\\n</tool_call>' }}"
    "{%- endfor %}"
    "{{- '<|im_end|>\\n' }}"
    "{%- elif message['role'] == 'tool' %}"
    "{{- '<|im_start|>user\\n<tool_response>\\n' + message['content'] + '\\n</tool_response><|im_end|>\\n' }}"
    "{%- else %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)

# Qwen3's template shape: Hermes turns; the generation prompt opens the assistant turn, and with
# `enable_thinking` false it writes an empty <think></think> block so the model answers directly.
_HERMES_GENERATION_PROMPT = "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
QWEN3_TEMPLATE = HERMES_TEMPLATE.removesuffix(_HERMES_GENERATION_PROMPT) + (
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}"
    "{%- if enable_thinking is defined and enable_thinking is false %}"
    "{{- '<think>\\n\\n</think>\\n\\n' }}"
    "{%- endif %}"
    "{%- endif %}"
)

# Mistral v0.3's template shape: [AVAILABLE_TOOLS] before the last user turn, calls after [TOOL_CALLS]
# as one JSON list, results in [TOOL_RESULTS] (call ids of 9 characters).
MISTRAL_TEMPLATE = (
    "{%- set ns = namespace(last_user=-1) %}"
    "{%- for message in messages %}{%- if message['role'] == 'user' %}"
    "{%- set ns.last_user = loop.index0 %}{%- endif %}{%- endfor %}"
    "{{- bos_token }}"
    "{%- for message in messages %}"
    "{%- if message['role'] == 'user' %}"
    "{%- if tools and loop.index0 == ns.last_user %}"
    "{{- '[AVAILABLE_TOOLS] ' + (tools | tojson) + '[/AVAILABLE_TOOLS]' }}"
    "{%- endif %}"
    "{{- '[INST] ' + message['content'] + '[/INST]' }}"
    "{%- elif message['role'] == 'system' %}"
    "{{- '[INST] ' + message['content'] + '[/INST]' }}"
    "{%- elif message['role'] == 'assistant' and message.tool_calls %}"
    "{{- '[TOOL_CALLS] [' }}"
    "{%- for call in message.tool_calls %}"
    "{%- if call.id is not defined or call.id | length != 9 %}"
    "{{- raise_exception('tool call ids must be 9 characters') }}{%- endif %}"
    "{%- if not loop.first %}{{- ', ' }}{%- endif %}"
    '{{- \'{"name": "\' + call.function.name + \'", "arguments": \' + (call.function.arguments | tojson) }}'
    "{{- ', \"id\": \"' + call.id + '\"}' }}"
    "{%- endfor %}"
    "{{- ']' + eos_token }}"
    "{%- elif message['role'] == 'assistant' %}"
    "{{- ' ' + message['content'] + eos_token }}"
    "{%- elif message['role'] == 'tool' %}"
    "{{- '[TOOL_RESULTS] {\"content\": ' + (message['content'] | tojson) + ', \"call_id\": \"' }}"
    "{{- message['tool_call_id'] + '\"}[/TOOL_RESULTS]' }}"
    "{%- endif %}"
    "{%- endfor %}"
)


@dataclasses.dataclass(frozen=True)
class ChatFormat:
    """A checkpoint family's chat tokens and template (the tool-call syntax comes with the template)."""

    template: str
    bos: str
    eos: str  # end of an assistant turn
    extra_special: tuple[str, ...] = ()  # special tokens beyond SPECIAL_TOKENS
    extra_added: tuple[str, ...] = ()  # added, non-special tokens (Qwen's <tool_call>)


CHAT_FORMATS: dict[str, ChatFormat] = {
    "llama3": ChatFormat(CHAT_TEMPLATE, BOS_TOKEN, EOS_TOKEN),
    "hermes": ChatFormat(
        HERMES_TEMPLATE,
        BOS_TOKEN,
        "<|im_end|>",
        extra_special=("<|im_start|>", "<|im_end|>"),
        extra_added=("<tool_call>", "</tool_call>"),
    ),
    "qwen3": ChatFormat(
        QWEN3_TEMPLATE,
        BOS_TOKEN,
        "<|im_end|>",
        extra_special=("<|im_start|>", "<|im_end|>"),
        extra_added=("<tool_call>", "</tool_call>", "<think>", "</think>"),
    ),
    "mistral": ChatFormat(
        MISTRAL_TEMPLATE,
        "<s>",
        "</s>",
        extra_special=(
            "<s>",
            "</s>",
            "[INST]",
            "[/INST]",
            "[TOOL_CALLS]",
            "[AVAILABLE_TOOLS]",
            "[/AVAILABLE_TOOLS]",
            "[TOOL_RESULTS]",
            "[/TOOL_RESULTS]",
        ),
    ),
}
