"""Tiny random-weight Hugging Face checkpoints and a locally trained tokenizer, for tests and demos.

The checkpoint is what `transformers` `save_pretrained(safe_serialization=True)` writes for
LlamaForCausalLM / MistralForCausalLM / Qwen2ForCausalLM (config.json, model.safetensors,
generation_config.json), plus a byte-level BPE tokenizer (GPT-2 / Llama-3 style byte-level
pre-tokenizer) with Llama-3's special tokens and chat template format, so the engine loads it exactly
as it would load a published checkpoint. Nothing is downloaded.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from pathlib import Path
from typing import Any

import torch
from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, processors, trainers
from transformers import (
    GenerationConfig,
    LlamaConfig,
    LlamaForCausalLM,
    MistralConfig,
    MistralForCausalLM,
    PreTrainedConfig,
    PreTrainedModel,
    PreTrainedTokenizerFast,
    Qwen2Config,
    Qwen2ForCausalLM,
)

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
MIN_TOKENIZER_VOCAB = 256 + len(SPECIAL_TOKENS) + 8  # byte alphabet + specials + a few merges

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

# A few KB of plain English (with digits and punctuation) to train the BPE merges on.
CORPUS = """\
The quick brown fox jumps over the lazy dog. A serving engine turns prompts into tokens, one step at a
time, and every step runs the whole batch through the model together.

Once upon a time there was a small model that lived on a busy machine. Every morning it woke up, read
the questions that people had sent during the night, and answered them as well as it could. Some
questions were about the weather, some were about cooking, and some were about numbers like 3, 14,
42, 100 and 2048.

Hello! How are you today? I am fine, thank you. What would you like to talk about? Let us talk about
books, music, gardens, rivers, mountains and the long history of the world.

The cache keeps recently used blocks in memory. When memory runs out, the oldest request that is not
running is moved back to the waiting queue, and its blocks are freed for the others.

She opened the window and looked at the garden. The flowers were red, yellow, blue and white, and
the grass was still wet from the rain. Birds were singing in the trees, and a cat was sleeping in the
sun near the door.

In 1969, people walked on the moon for the first time. Today, computers are millions of times faster
than the ones that helped them get there, and a phone in your pocket can answer questions in seconds.

Please write a short poem about the sea. The sea is wide, the sea is deep; it sings the sailors off to
sleep. The waves come in, the waves go out, and that is what the sea is about.

To make a cup of tea, boil some water, put a tea bag in a cup, pour the water over it, wait three or
four minutes, and then add milk or sugar if you like. Tea is popular in many countries.

Question: what is two plus two? Answer: two plus two is four. Question: what is the capital of
France? Answer: the capital of France is Paris. Question: how many days are in a week? Answer: seven.

The user asked the assistant for help with a program. The assistant explained that the function
should return a list of numbers, sorted from the smallest to the largest, without changing the input.

def add(a, b):
    return a + b

for i in range(10):
    print(i * i)

Mountains rise above the clouds, and rivers run down to the valleys. Farmers plant seeds in the
spring, water them in the summer, and bring in the harvest in the autumn before the winter snow.

An adapter is a small set of extra weights that changes how a large model behaves. Many adapters can
share one base model, so a single machine can serve many different users at the same time.

The children played a game in the park until it was dark. Then they walked home, ate dinner with
their families, told stories about their day, and went to bed early because school started at eight.

Good morning, everyone. Today we will learn about the planets: Mercury, Venus, Earth, Mars, Jupiter,
Saturn, Uranus and Neptune. Earth is the third planet from the sun and the only one we know with life.
"""

_ARCHS: dict[str, tuple[type[PreTrainedConfig], type[PreTrainedModel]]] = {
    "llama": (LlamaConfig, LlamaForCausalLM),
    "mistral": (MistralConfig, MistralForCausalLM),
    "qwen2": (Qwen2Config, Qwen2ForCausalLM),
}


@functools.lru_cache(maxsize=8)
def _trained_tokenizer_json(
    vocab_size: int,
    extra_special: tuple[str, ...] = (),
    extra_added: tuple[str, ...] = (),
    bos: str = BOS_TOKEN,
) -> str:
    """Train once per vocab size; the BPE trainer is deterministic on a fixed corpus."""
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    num_added = len(SPECIAL_TOKENS) + len(extra_special) + len(extra_added)
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size - num_added,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),  # every byte encodes: no unknown tokens
        show_progress=False,
    )
    tokenizer.train_from_iterator(CORPUS.split("\n\n"), trainer=trainer)
    tokenizer.add_special_tokens(list(SPECIAL_TOKENS) + list(extra_special))
    if extra_added:
        tokenizer.add_tokens([AddedToken(t, special=False, normalized=False) for t in extra_added])
    bos_id = tokenizer.token_to_id(bos)
    # Llama 3 prepends <|begin_of_text|> when encoding with add_special_tokens=True (Mistral its <s>).
    tokenizer.post_processor = processors.TemplateProcessing(
        single=f"{bos} $A", pair=f"{bos} $A {bos} $B", special_tokens=[(bos, bos_id)]
    )
    return tokenizer.to_str()


def build_tokenizer(vocab_size: int = 512, chat_format: str = "llama3") -> PreTrainedTokenizerFast:
    """A byte-level BPE tokenizer of at most `vocab_size` ids with Llama-3 specials and chat template.

    Same vocabulary on every call. Specials take the last ids: bos `<|begin_of_text|>`, eos `<|eot_id|>`.
    `chat_format` "hermes" (Qwen2.5's ChatML + <tool_call>) or "mistral" (v0.3's [INST] + [TOOL_CALLS])
    adds that family's tokens after Llama 3's and uses its template, bos and eos instead.
    """
    if vocab_size < MIN_TOKENIZER_VOCAB:
        raise ValueError(f"tokenizer vocab_size={vocab_size} too small; expected >= {MIN_TOKENIZER_VOCAB}")
    if chat_format not in CHAT_FORMATS:
        raise ValueError(f"unknown chat_format {chat_format!r}; expected one of {sorted(CHAT_FORMATS)}")
    fmt = CHAT_FORMATS[chat_format]
    additional = [END_OF_TEXT_TOKEN, START_HEADER_TOKEN, END_HEADER_TOKEN]
    additional += [t for t in (BOS_TOKEN, EOS_TOKEN) if t not in (fmt.bos, fmt.eos)]
    additional += [t for t in fmt.extra_special if t not in (fmt.bos, fmt.eos)]
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=Tokenizer.from_str(
            _trained_tokenizer_json(vocab_size, fmt.extra_special, fmt.extra_added, fmt.bos)
        ),
        bos_token=fmt.bos,
        eos_token=fmt.eos,
        additional_special_tokens=additional,
        clean_up_tokenization_spaces=False,
        model_max_length=131072,
    )
    tokenizer.chat_template = fmt.template
    return tokenizer


def _randomize_(model: PreTrainedModel, init_scale: float) -> None:
    """Re-draw every parameter so that forgetting to load any of them changes outputs.

    transformers initialises norms to 1 and biases to 0; an engine that skipped loading them would
    still match. Norm weights become 1 + noise and biases small noise. Matrices get std
    init_scale / sqrt(fan_in): each projection then keeps activations at a similar size whatever the
    hidden size, logits have std ~init_scale, so top-1 gaps sit far above float noise and greedy
    decoding does not collapse into repeating one token (it does with std 0.02).
    """
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name:
                param.copy_(1.0 + 0.1 * torch.randn_like(param))
            elif name.endswith(".bias"):
                param.normal_(0.0, 0.05)
            else:
                param.normal_(0.0, init_scale / math.sqrt(param.shape[-1]))


def _build_config(arch: str, overrides: dict[str, Any]) -> PreTrainedConfig:
    if arch not in _ARCHS:
        raise ValueError(f"unknown arch {arch!r}; expected one of {sorted(_ARCHS)}")
    config_cls, _ = _ARCHS[arch]
    if arch == "mistral":
        # Mistral defaults to a 4096 window; none means full attention, which every engine can serve.
        overrides.setdefault("sliding_window", None)
    return config_cls(**overrides)


def save_random_checkpoint(
    path: Path,
    *,
    arch: str = "llama",
    hidden_size: int = 64,
    num_hidden_layers: int = 2,
    num_attention_heads: int = 4,
    num_key_value_heads: int = 2,
    intermediate_size: int = 128,
    vocab_size: int = 512,
    tie_word_embeddings: bool = False,
    seed: int = 0,
    chat_format: str = "llama3",
    dtype: torch.dtype = torch.float32,
    max_position_embeddings: int = 2048,
    init_scale: float = 1.6,
    **config_overrides: Any,
) -> Path:
    """Write a random-weight HF checkpoint (safetensors + tokenizer + generation config) to `path`.

    `config_overrides` go to the transformers config (e.g. `head_dim`, `rope_parameters`,
    `attention_bias`, `sliding_window`); `init_scale` sets the weights' size (see `_randomize_`).
    Same arguments, same weights. Returns `path`.
    """
    path = Path(path)
    tokenizer = build_tokenizer(min(vocab_size, 512), chat_format)
    if len(tokenizer) > vocab_size:
        raise ValueError(f"model vocab_size={vocab_size} is smaller than the tokenizer's {len(tokenizer)}")
    bos_id = tokenizer.bos_token_id
    eot_id = tokenizer.eos_token_id
    end_of_text_id = tokenizer.convert_tokens_to_ids(END_OF_TEXT_TOKEN)
    fields: dict[str, Any] = {
        "hidden_size": hidden_size,
        "num_hidden_layers": num_hidden_layers,
        "num_attention_heads": num_attention_heads,
        "num_key_value_heads": num_key_value_heads,
        "intermediate_size": intermediate_size,
        "vocab_size": vocab_size,
        "tie_word_embeddings": tie_word_embeddings,
        "max_position_embeddings": max_position_embeddings,
        # config.json carries the base-model eos (like Llama-3 base); generation_config.json the list.
        "bos_token_id": bos_id,
        "eos_token_id": end_of_text_id,
        **config_overrides,
    }
    config = _build_config(arch, fields)
    _, model_cls = _ARCHS[arch]
    torch.manual_seed(seed)
    model = model_cls(config)
    _randomize_(model, init_scale)
    model = model.to(dtype)
    model.config.dtype = dtype
    model.generation_config = GenerationConfig(bos_token_id=bos_id, eos_token_id=[eot_id, end_of_text_id])
    path.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(path, safe_serialization=True)
    tokenizer.save_pretrained(path)
    return path
