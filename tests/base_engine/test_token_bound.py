"""base_engine/model/token_bound.py: `least_tokens(text)` never exceeds what the tokenizer really makes of the
text (property test on byte-level and SentencePiece-style BPE, hostile texts included), and tokenizers
that could shorten a text get no bound at all."""

from __future__ import annotations

from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from tokenizers import AddedToken, Tokenizer, models, normalizers, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

from base_engine.model.token_bound import least_tokens, max_chars_per_token
from base_engine.model.tokenizer import load_tokenizer
from base_engine.testing.tokenizer import CORPUS


def _fast(tok: Tokenizer) -> PreTrainedTokenizerFast:
    return PreTrainedTokenizerFast(tokenizer_object=tok)


def _trained(tok: Tokenizer, **trainer_args: object) -> PreTrainedTokenizerFast:
    trainer = trainers.BpeTrainer(vocab_size=400, show_progress=False, **trainer_args)  # type: ignore[arg-type]
    tok.train_from_iterator([CORPUS, "-" * 64 + " " * 64 + "#" * 64], trainer=trainer)
    return _fast(tok)


def _llama2_style() -> PreTrainedTokenizerFast:
    """SentencePiece-style BPE as Llama 2's tokenizer.json has it: Prepend + Replace, byte fallback."""
    tok = Tokenizer(models.BPE(byte_fallback=True, unk_token="<unk>", fuse_unk=True))
    tok.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    fallback = [f"<0x{b:02X}>" for b in range(256)]
    fast = _trained(tok, special_tokens=["<unk>", "<s>", "</s>", *fallback])
    return fast


def _llama3_style() -> PreTrainedTokenizerFast:
    """Byte-level BPE behind a regex split, as Llama 3's tokenizer.json has it."""
    tok = Tokenizer(models.BPE())
    split = pre_tokenizers.Split(r"\s+|\p{L}+|\p{N}{1,3}|[^\s\p{L}\p{N}]+", behavior="isolated")
    tok.pre_tokenizer = pre_tokenizers.Sequence([split, pre_tokenizers.ByteLevel(use_regex=False)])
    return _trained(tok, initial_alphabet=pre_tokenizers.ByteLevel.alphabet())


@pytest.fixture(scope="module")
def tokenizers_under_test(tiny_llama_dir: Path) -> list[PreTrainedTokenizerFast]:
    return [load_tokenizer(tiny_llama_dir), _llama2_style(), _llama3_style()]


def _hostile_texts() -> st.SearchStrategy[str]:
    runs = st.sampled_from(["-", " ", "#", "\n", "é", "\u0301", "🙂", "a", "<|begin_of_text|>", "the "])
    repeated = st.tuples(runs, st.integers(1, 300)).map(lambda pair: pair[0] * pair[1])
    return st.lists(st.one_of(repeated, st.text(max_size=40)), max_size=8).map("".join)


@pytest.mark.slow
@settings(max_examples=150, deadline=None)
@given(text=_hostile_texts())
def test_least_tokens_is_a_lower_bound(
    tokenizers_under_test: list[PreTrainedTokenizerFast], text: str
) -> None:
    for tokenizer in tokenizers_under_test:
        assert max_chars_per_token(tokenizer) is not None
        ids = tokenizer.encode(text, add_special_tokens=False)
        assert len(ids) >= least_tokens(tokenizer, text), (tokenizer.backend_tokenizer.normalizer, text)


def test_the_bound_is_the_longest_vocabulary_entry(tiny_llama_dir: Path) -> None:
    tokenizer = load_tokenizer(tiny_llama_dir)
    longest = max(len(entry) for entry in tokenizer.get_vocab())
    assert max_chars_per_token(tokenizer) == longest
    assert least_tokens(tokenizer, "x" * (10 * longest + 1)) == 11 and least_tokens(tokenizer, "") == 0


def _with_lstrip() -> PreTrainedTokenizerFast:
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel()
    fast = _trained(tok, initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    fast.add_tokens([AddedToken("<mask>", lstrip=True)])
    return fast


UNSOUND = {
    "nfkc_normalizer": lambda: _set(normalizer=normalizers.NFKC()),
    "strip_normalizer": lambda: _set(normalizer=normalizers.Strip()),
    "replace_shortening": lambda: _set(normalizer=normalizers.Replace("  ", " ")),
    "whitespace_pre_tokenizer": lambda: _set(pre_tokenizer=pre_tokenizers.Whitespace()),
    "split_removing": lambda: _set(pre_tokenizer=pre_tokenizers.Split(" ", behavior="removed")),
    "word_level_model": lambda: _fast(Tokenizer(models.WordLevel({"[UNK]": 0}, unk_token="[UNK]"))),
    "fused_unknowns": lambda: _fast(
        Tokenizer(models.BPE({"<unk>": 0, "a": 1}, [], unk_token="<unk>", fuse_unk=True))
    ),
    "lstrip_added_token": _with_lstrip,
}


def _set(**parts: object) -> PreTrainedTokenizerFast:
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel()
    for name, part in parts.items():
        setattr(tok, name, part)
    return _trained(tok, initial_alphabet=pre_tokenizers.ByteLevel.alphabet())


@pytest.mark.parametrize("case", list(UNSOUND))
def test_tokenizers_that_may_shorten_text_get_no_bound(case: str) -> None:
    tokenizer = UNSOUND[case]()
    assert max_chars_per_token(tokenizer) is None
    assert least_tokens(tokenizer, "x" * 100_000) == 0


def test_why_absorbing_added_tokens_get_no_bound() -> None:
    tokenizer = _with_lstrip()
    text = " " * 10_000 + "<mask>"  # ten thousand characters in two tokens at most
    assert len(tokenizer.encode(text, add_special_tokens=False)) <= 2
