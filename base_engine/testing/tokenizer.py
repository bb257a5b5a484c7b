"""The tiny checkpoints' tokenizer: byte-level BPE (GPT-2 / Llama-3 style byte-level pre-tokenizer) trained
locally on a few KB of English, with Llama 3's special tokens after the trained ids and one of the chat
formats of tiny_chat_formats.py. Deterministic, nothing downloaded."""

from __future__ import annotations

import functools

from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, processors, trainers
from transformers import PreTrainedTokenizerFast

from base_engine.testing.chat_formats import (
    BOS_TOKEN,
    CHAT_FORMATS,
    END_HEADER_TOKEN,
    END_OF_TEXT_TOKEN,
    EOS_TOKEN,
    SPECIAL_TOKENS,
    START_HEADER_TOKEN,
)

MIN_TOKENIZER_VOCAB = 256 + len(SPECIAL_TOKENS) + 8  # byte alphabet + specials + a few merges

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
    `chat_format` "hermes" (Qwen2.5's ChatML + <tool_call>), "qwen3" (hermes + <think>, enable_thinking)
    or "mistral" (v0.3's [INST] + [TOOL_CALLS]) adds that family's tokens after Llama 3's and uses its
    template, bos and eos instead.
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
