"""The locally trained tokenizer, load_tokenizer and the chat template (checked against transformers)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from transformers import AutoTokenizer

from base_engine.model.tokenizer import CHAT_TEMPLATE_FILE, apply_chat_template, load_tokenizer, render_chat
from base_engine.testing import tokenizer as tiny_tokenizer
from base_engine.testing.chat_formats import BOS_TOKEN, END_OF_TEXT_TOKEN, EOS_TOKEN, SPECIAL_TOKENS
from base_engine.testing.tokenizer import build_tokenizer

TEXTS = [
    "The quick brown fox jumps over the lazy dog.",
    "  leading spaces, tabs\tand\nnew lines  ",
    "Unicode: café, naïve, 東京, emoji 🦙🚀, and a zero-width\u200bjoiner.",
    "numbers 3.14159 and code: def f(x): return x ** 2",
]
MESSAGES = [
    {"role": "system", "content": "You are helpful."},
    {"role": "user", "content": "  Hi there!  "},
]


def test_build_tokenizer_is_deterministic() -> None:
    first = build_tokenizer()
    tiny_tokenizer._trained_tokenizer_json.cache_clear()  # train again from scratch
    second = build_tokenizer()
    assert first.backend_tokenizer.to_str() == second.backend_tokenizer.to_str()
    assert len(first) == 512


def test_specials_take_the_last_ids() -> None:
    tokenizer = build_tokenizer(400)
    assert len(tokenizer) == 400
    ids = tokenizer.convert_tokens_to_ids(list(SPECIAL_TOKENS))
    assert sorted(ids) == list(range(400 - len(SPECIAL_TOKENS), 400))
    assert tokenizer.bos_token == BOS_TOKEN and tokenizer.eos_token == EOS_TOKEN
    assert tokenizer.encode(EOS_TOKEN, add_special_tokens=False) == [tokenizer.eos_token_id]
    with pytest.raises(ValueError, match="vocab_size=100"):
        build_tokenizer(100)


@pytest.mark.parametrize("text", TEXTS)
def test_byte_level_round_trip(text: str) -> None:
    tokenizer = build_tokenizer()
    ids = tokenizer.encode(text, add_special_tokens=False)
    assert tokenizer.decode(ids) == text
    assert max(ids) < len(tokenizer) - len(SPECIAL_TOKENS)  # text never produces a special id


def test_merges_compress_english() -> None:
    tokenizer = build_tokenizer()
    text = "Once upon a time there was a small model that lived on a busy machine."
    assert len(tokenizer.encode(text, add_special_tokens=False)) < len(text.encode()) / 2


def test_encode_prepends_bos_like_llama3() -> None:
    tokenizer = build_tokenizer()
    ids = tokenizer.encode("hello", add_special_tokens=True)
    assert ids[0] == tokenizer.bos_token_id
    assert ids[1:] == tokenizer.encode("hello", add_special_tokens=False)


def test_load_tokenizer_matches_built_one(tiny_llama_dir: Path) -> None:
    loaded = load_tokenizer(tiny_llama_dir)
    built = build_tokenizer()
    for text in TEXTS:
        assert loaded.encode(text) == built.encode(text)
    generation = json.loads((tiny_llama_dir / "generation_config.json").read_text())
    assert loaded.convert_ids_to_tokens(generation["eos_token_id"]) == [EOS_TOKEN, END_OF_TEXT_TOKEN]


def test_chat_template_llama3_format(tiny_llama_dir: Path) -> None:
    tokenizer = load_tokenizer(tiny_llama_dir)
    assert (tiny_llama_dir / CHAT_TEMPLATE_FILE).is_file()  # transformers 5 writes the template here
    expected_text = (
        "<|begin_of_text|><|start_header_id|>system<|end_header_id|>\n\nYou are helpful.<|eot_id|>"
        "<|start_header_id|>user<|end_header_id|>\n\nHi there!<|eot_id|>"
        "<|start_header_id|>assistant<|end_header_id|>\n\n"
    )
    assert render_chat(tokenizer, MESSAGES) == expected_text
    ids = apply_chat_template(tokenizer, MESSAGES)
    assert ids.count(tokenizer.bos_token_id) == 1 and ids[0] == tokenizer.bos_token_id
    assert tokenizer.decode(ids) == expected_text
    # Oracle: transformers' own tokenizing path over the same template.
    hf = AutoTokenizer.from_pretrained(tiny_llama_dir, local_files_only=True)
    reference = hf.apply_chat_template(MESSAGES, add_generation_prompt=True, tokenize=True)
    assert ids == list(reference["input_ids"] if hasattr(reference, "keys") else reference)
    without_prompt = render_chat(tokenizer, MESSAGES, add_generation_prompt=False)
    assert without_prompt == expected_text.removesuffix("<|start_header_id|>assistant<|end_header_id|>\n\n")


def test_template_in_tokenizer_config(tiny_llama_dir: Path, tmp_path: Path) -> None:
    """Published checkpoints (before transformers 4.43) keep the template inside tokenizer_config.json."""
    model_dir = Path(shutil.copytree(tiny_llama_dir, tmp_path / "m"))
    template = (model_dir / CHAT_TEMPLATE_FILE).read_text()
    (model_dir / CHAT_TEMPLATE_FILE).unlink()
    tokenizer_config = json.loads((model_dir / "tokenizer_config.json").read_text())
    tokenizer_config["chat_template"] = template.replace("'<|eot_id|>'", "'<|eot_id|>' + ''")
    (model_dir / "tokenizer_config.json").write_text(json.dumps(tokenizer_config))
    tokenizer = load_tokenizer(model_dir)
    assert tokenizer.chat_template == tokenizer_config["chat_template"]
    assert apply_chat_template(tokenizer, MESSAGES) == apply_chat_template(
        load_tokenizer(tiny_llama_dir), MESSAGES
    )


def test_no_chat_template_is_a_clear_error(tiny_llama_dir: Path, tmp_path: Path) -> None:
    model_dir = Path(shutil.copytree(tiny_llama_dir, tmp_path / "m"))
    (model_dir / CHAT_TEMPLATE_FILE).unlink()
    tokenizer = load_tokenizer(model_dir)
    assert tokenizer.encode("hello")  # completions still work
    with pytest.raises(ValueError, match="no chat template"):
        apply_chat_template(tokenizer, MESSAGES)


def test_template_errors_become_value_errors(tiny_llama_dir: Path) -> None:
    tokenizer = load_tokenizer(tiny_llama_dir)
    tokenizer.chat_template = "{{ raise_exception('roles must alternate') }}"
    with pytest.raises(ValueError, match="roles must alternate"):
        apply_chat_template(tokenizer, MESSAGES)


def test_missing_tokenizer_files(tiny_llama_dir: Path, tmp_path: Path) -> None:
    model_dir = tmp_path / "m"
    model_dir.mkdir()
    shutil.copy(tiny_llama_dir / "config.json", model_dir / "config.json")
    with pytest.raises(FileNotFoundError, match=r"no tokenizer\.json in .*config\.json"):
        load_tokenizer(model_dir)


@pytest.mark.parametrize("enable_thinking", [None, True, False])
def test_template_variables_render_as_transformers_renders_them(tmp_path: Path, enable_thinking) -> None:
    """Qwen3's `enable_thinking` reaches the template: false writes the empty think block."""
    build_tokenizer(chat_format="qwen3").save_pretrained(tmp_path)
    variables = {} if enable_thinking is None else {"enable_thinking": enable_thinking}
    ours = render_chat(load_tokenizer(tmp_path), MESSAGES, variables=variables)
    reference = AutoTokenizer.from_pretrained(tmp_path).apply_chat_template(
        MESSAGES, tokenize=False, add_generation_prompt=True, **variables
    )
    assert ours == reference
    assert ours.endswith("<think>\n\n</think>\n\n") == (enable_thinking is False)


@pytest.mark.parametrize(
    ("variables", "message"),
    [
        ({"add_generation_prompt": False}, r"'add_generation_prompt' would replace"),
        ({"tools": []}, r"'tools' would replace"),
        ({"messages": []}, r"'messages' would replace"),
        ({"raise_exception": 1}, r"'raise_exception' would replace"),
        ({"namespace": 1}, r"'namespace' would replace"),
        ({"not-a-name": 1}, r"'not-a-name' is not a name"),
        ({"_private": 1}, r"'_private' is not a name"),
    ],
)
def test_template_variables_may_not_replace_what_the_render_sets(variables, message) -> None:
    with pytest.raises(ValueError, match=message):
        render_chat(build_tokenizer(chat_format="qwen3"), MESSAGES, variables=variables)


def test_a_variable_the_template_cannot_use_is_a_value_error() -> None:
    tokenizer = build_tokenizer()
    tokenizer.chat_template = "{{ bos_token + messages[0]['content'] + suffix }}"
    with pytest.raises(ValueError, match="the chat template rejected"):
        render_chat(tokenizer, MESSAGES, variables={"suffix": 3})
