"""`skip_special_tokens` and vLLM's `spaces_between_special_tokens` in the incremental detokenizer, on
tokenizers with added special tokens: a WordPiece decoder (which puts a space between every two
tokens, so the option shows) and the byte-level BPE of the test checkpoints (which puts none)."""

from __future__ import annotations

import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

from base_engine.detokenizer import Detokenizer
from base_engine.sampling_params import SamplingParams
from base_engine.testing.tokenizer import build_tokenizer


@pytest.fixture(scope="module")
def wordpiece() -> PreTrainedTokenizerFast:
    tok = Tokenizer(
        models.WordPiece({"[UNK]": 0, "hello": 1, "world": 2, "##s": 3, "good": 4}, unk_token="[UNK]")
    )
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.decoder = decoders.WordPiece()
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, unk_token="[UNK]", additional_special_tokens=["[A]", "[B]"],
        clean_up_tokenization_spaces=False,
    )  # fmt: skip


def _stream(tokenizer, ids: list[int], **options) -> str:
    detok = Detokenizer(tokenizer, SamplingParams(**options))
    streamed = []
    for token_id in ids:
        detok.update([token_id])
        streamed.append(detok.take_delta())
    streamed.append(detok.take_delta(is_final=True))
    assert "".join(streamed) == detok.text  # what streams is what the final text holds
    return detok.text


def test_wordpiece_spaces_between_special_tokens(wordpiece) -> None:
    a, b = wordpiece.convert_tokens_to_ids(["[A]", "[B]"])
    ids = [1, a, b, 2, 3, b, 4]
    keep = {"skip_special_tokens": False}
    assert _stream(wordpiece, ids, **keep) == wordpiece.decode(ids, skip_special_tokens=False)
    assert _stream(wordpiece, ids, **keep) == "hello [A] [B] worlds [B] good"  # the default: true
    # vLLM's rule: an added token right after another is written bare; elsewhere the decoder's spaces stay.
    assert (
        _stream(wordpiece, ids, **keep, spaces_between_special_tokens=False) == "hello [A][B] worlds [B] good"
    )
    for spaces in (True, False):  # skipped special tokens leave nothing to space
        text = _stream(wordpiece, ids, spaces_between_special_tokens=spaces)
        assert text == wordpiece.decode(ids, skip_special_tokens=True) == "hello worlds good"


def test_byte_level_has_no_spaces_to_remove() -> None:
    tokenizer = build_tokenizer()
    specials = [tokenizer.convert_tokens_to_ids(t) for t in tokenizer.all_special_tokens]
    ids = [40, 41, *specials[:3], 42, specials[0], 43]
    keep = {"skip_special_tokens": False}
    full = tokenizer.decode(ids, skip_special_tokens=False)
    assert (
        _stream(tokenizer, ids, **keep)
        == full
        == _stream(tokenizer, ids, **keep, spaces_between_special_tokens=False)
    )
    assert _stream(tokenizer, ids) == tokenizer.decode(ids, skip_special_tokens=True)
    assert not any(t in _stream(tokenizer, ids) for t in tokenizer.all_special_tokens)
