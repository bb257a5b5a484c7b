"""Incremental detokenizer against ``tokenizer.decode`` of the whole output, on two tiny tokenizers
trained here: a byte-level BPE (Llama 3 / GPT-2 style) and a sentencepiece-style BPE with byte
fallback and a leading-space-stripping decoder (Llama 2 style)."""

from __future__ import annotations

import json
from collections.abc import Sequence

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

from base_engine.detokenizer import Detokenizer
from base_engine.sampling_params import SamplingParams

CORPUS = [
    "héllo 世界 🙂 hello world, the quick brown fox jumps over the lazy dog. " * 3,
    "Ünïcödé façade naïve café — 日本語のテキスト, 世界は広い. 🙂🙃 emoji and ascii mixed text! ",
    "STOP here ### end of text. héllo again, 世界 says hello 🙂. " * 2,
]
ALPHABET = list("ab lo.#\nhé世界日本🙂🙃—")
TEXTS = [
    "héllo 世界 🙂 hello world",
    "日本語のテキスト🙂🙃 façade",
    "a🙂b🙃c 世 界 é",
    "plain ascii only. ### done",
]


def byte_level_tokenizer() -> PreTrainedTokenizerFast:
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=400,
        special_tokens=["<|begin_of_text|>", "<|eot_id|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(CORPUS, trainer)
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token="<|begin_of_text|>",
        eos_token="<|eot_id|>",
        clean_up_tokenization_spaces=False,
    )


def sentencepiece_tokenizer() -> PreTrainedTokenizerFast:
    tok = Tokenizer(models.BPE(unk_token="<unk>", fuse_unk=True, byte_fallback=True))
    tok.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    tok.decoder = decoders.Sequence(
        [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(), decoders.Strip(" ", 1, 0)]
    )
    trainer = trainers.BpeTrainer(
        vocab_size=300, special_tokens=["<unk>", "<s>", "</s>"], show_progress=False
    )
    # Emoji stay out of training so that they are encoded as <0xXX> byte tokens.
    tok.train_from_iterator([c.replace("🙂", "").replace("🙃", "") for c in CORPUS], trainer)
    spec = json.loads(tok.to_str())
    vocab = spec["model"]["vocab"]
    for byte in range(256):
        vocab.setdefault(f"<0x{byte:02X}>", len(vocab))
    tok = Tokenizer.from_str(json.dumps(spec))
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token="<s>",
        eos_token="</s>",
        unk_token="<unk>",
        clean_up_tokenization_spaces=False,
    )


TOKENIZERS = {"byte_level": byte_level_tokenizer(), "sentencepiece": sentencepiece_tokenizer()}


class SlowPathTokenizer(PreTrainedTokenizerFast):
    """Overrides _decode, so the detokenizer must go through tokenizer.decode (the generic path)."""

    def _decode(self, token_ids, skip_special_tokens=False, clean_up_tokenization_spaces=None, **kwargs):  # type: ignore[no-untyped-def]
        return super()._decode(token_ids, skip_special_tokens, clean_up_tokenization_spaces, **kwargs)


TOKENIZERS["slow_path"] = SlowPathTokenizer(
    tokenizer_object=TOKENIZERS["byte_level"].backend_tokenizer,
    eos_token="<|eot_id|>",
    clean_up_tokenization_spaces=False,
)


@pytest.fixture(params=list(TOKENIZERS))
def tokenizer(request: pytest.FixtureRequest) -> PreTrainedTokenizerFast:
    return TOKENIZERS[request.param]


def decode(tokenizer: PreTrainedTokenizerFast, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
    return tokenizer.decode(
        list(ids), skip_special_tokens=skip_special_tokens, clean_up_tokenization_spaces=False
    )


def encode(tokenizer: PreTrainedTokenizerFast, text: str) -> list[int]:
    return tokenizer.encode(text, add_special_tokens=False)


def stream(
    tokenizer: PreTrainedTokenizerFast,
    params: SamplingParams,
    ids: Sequence[int],
    prompt: Sequence[int] = (),
    chunks: Sequence[int] = (),
) -> tuple[list[str], str | None, Detokenizer]:
    """Feeds ``ids`` in chunks of the given sizes (1 when exhausted), taking a delta after each."""
    detok = Detokenizer(tokenizer, params, prompt)
    deltas, stop, pos, step = [], None, 0, 0
    while pos < len(ids) and stop is None:
        size = chunks[step] if step < len(chunks) else 1
        stop = detok.update(ids[pos : pos + size])
        pos, step = pos + size, step + 1
        deltas.append(detok.take_delta())
        if stop is None:  # once a stop matched, the text is final and all of it may go
            assert_no_partial_stop("".join(deltas), detok.text, params.stop)
    deltas.append(detok.take_delta(is_final=True))
    return deltas, stop, detok


def assert_no_partial_stop(streamed: str, text: str, stops: Sequence[str]) -> None:
    """Nothing streamed may start a piece of the text that could still grow into a stop string."""
    assert text.startswith(streamed)
    for start in range(max(0, len(streamed) - 10), len(streamed)):
        held = text[start:]
        assert not any(s.startswith(held) and s != held for s in stops), (streamed, text)


# ---- text ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("text", TEXTS)
def test_deltas_concatenate_to_decode_and_never_split_a_character(tokenizer, text: str) -> None:
    ids = encode(tokenizer, text)
    deltas, stop, detok = stream(tokenizer, SamplingParams(), ids)
    assert stop is None
    assert "".join(deltas) == detok.text == decode(tokenizer, ids)
    assert not any("\ufffd" in d for d in deltas)


@pytest.mark.parametrize("text", TEXTS)
def test_prompt_context_gives_the_boundary_right(tokenizer, text: str) -> None:
    # Sentencepiece drops the leading space of a decoded text; after a prompt it must stay.
    prompt = encode(tokenizer, "the quick brown fox says")
    ids = encode(tokenizer, " " + text)
    deltas, _, detok = stream(tokenizer, SamplingParams(), ids, prompt=prompt)
    assert decode(tokenizer, prompt) + "".join(deltas) == decode(tokenizer, prompt + ids)
    assert "".join(deltas) == detok.text


def test_incomplete_character_is_held_until_it_completes() -> None:
    tokenizer = TOKENIZERS["sentencepiece"]
    ids = encode(tokenizer, "a🙂")
    assert len(ids) >= 4  # the emoji is four byte-fallback tokens
    detok = Detokenizer(tokenizer, SamplingParams(), [])
    seen = []
    for token in ids:
        detok.update([token])
        seen.append(detok.take_delta())
    assert seen[-4:-1] == ["", "", ""]
    assert "".join(seen) == detok.text == "a🙂"


def test_final_flush_releases_an_incomplete_character_like_decode(tokenizer) -> None:
    ids = encode(tokenizer, "ok🙂")
    while "\ufffd" not in decode(tokenizer, ids):
        ids = ids[:-1]  # cut inside the emoji's bytes
    detok = Detokenizer(tokenizer, SamplingParams(), [])
    detok.update(ids)
    streamed = detok.take_delta()
    assert "\ufffd" not in streamed and "\ufffd" not in detok.text
    assert streamed + detok.take_delta(is_final=True) == decode(tokenizer, ids) == detok.text


@pytest.mark.parametrize("skip", [True, False])
def test_special_tokens_follow_skip_special_tokens(skip: bool) -> None:
    tokenizer = TOKENIZERS["byte_level"]
    ids = [*encode(tokenizer, "hello"), tokenizer.eos_token_id, *encode(tokenizer, " world")]
    deltas, _, detok = stream(tokenizer, SamplingParams(skip_special_tokens=skip), ids)
    assert "".join(deltas) == detok.text == decode(tokenizer, ids, skip_special_tokens=skip)
    assert ("<|eot_id|>" in detok.text) is not skip


class CountingTokenizer:
    """A real tokenizer that records how many ids each decode call sees."""

    def __init__(self, inner: PreTrainedTokenizerFast) -> None:
        self.inner = inner
        self.window_sizes: list[int] = []

    def decode(self, token_ids: list[int], **kwargs: bool) -> str:
        self.window_sizes.append(len(token_ids))
        return self.inner.decode(token_ids, **kwargs)


def test_each_step_decodes_a_short_window_only() -> None:
    inner = TOKENIZERS["byte_level"]
    counting = CountingTokenizer(inner)
    prompt = encode(inner, "héllo " * 50)
    ids = encode(inner, "héllo 世界 🙂 hello world, the quick brown fox. " * 20)
    deltas, _, detok = stream(counting, SamplingParams(), ids, prompt=prompt)  # type: ignore[arg-type]
    assert "".join(deltas) == detok.text == decode(inner, ids)
    assert len(counting.window_sizes) >= 2 * len(ids)
    assert max(counting.window_sizes) <= 5 + 4  # prompt context + at most one character's tokens


# ---- stop strings -------------------------------------------------------------------------------------


@pytest.mark.parametrize("include", [False, True])
def test_stop_string_spanning_tokens_is_found_and_cut(tokenizer, include: bool) -> None:
    text = "héllo 世界 🙂 hello world"
    ids = encode(tokenizer, text)
    stop = "lo 世"
    assert not any(stop in decode(tokenizer, [t]) for t in ids)  # it does span tokens
    params = SamplingParams(stop=["zzz", stop], include_stop_str_in_output=include)
    deltas, matched, detok = stream(tokenizer, params, ids)
    assert matched == stop
    expected = text[: text.index(stop) + (len(stop) if include else 0)]
    assert "".join(deltas) == detok.text == expected


def test_update_returns_the_stop_on_the_token_that_completes_it() -> None:
    tokenizer = TOKENIZERS["byte_level"]
    ids = encode(tokenizer, "hello world, the quick brown fox")
    detok = Detokenizer(tokenizer, SamplingParams(stop="world, the"), [])
    results = [
        detok.update([t])
        for t in ids[
            : next(i for i in range(len(ids)) if "world, the" in decode(tokenizer, ids[: i + 1])) + 1
        ]
    ]
    assert results[:-1] == [None] * (len(results) - 1) and results[-1] == "world, the"
    with pytest.raises(RuntimeError, match="world, the"):
        detok.update([ids[-1]])


def test_text_that_cannot_start_a_stop_is_not_held() -> None:
    tokenizer = TOKENIZERS["byte_level"]
    detok = Detokenizer(tokenizer, SamplingParams(stop="###"), [])
    detok.update(encode(tokenizer, "hello #"))
    assert detok.take_delta() == "hello "  # "#" may begin "###"
    detok.update(encode(tokenizer, " ok"))
    assert detok.take_delta() == "# ok"


def expected_cut(full: str, stops: Sequence[str], include: bool) -> tuple[str, str | None]:
    found = [(full.find(s) + len(s), full.find(s), s) for s in stops if s in full]
    if not found:
        return full, None
    end, start, stop = min(found)
    return full[: end if include else start], stop


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    text=st.text(alphabet=st.sampled_from(ALPHABET), max_size=30),
    data=st.data(),
    include=st.booleans(),
    chunks=st.lists(st.integers(1, 4), max_size=30),
)
def test_stop_strings_property(
    tokenizer, text: str, data: st.DataObject, include: bool, chunks: list[int]
) -> None:
    ids = encode(tokenizer, text)
    full = decode(tokenizer, ids)
    stops = data.draw(
        st.lists(st.text(alphabet=st.sampled_from(ALPHABET), min_size=1, max_size=4), max_size=3)
    )
    if full and data.draw(st.booleans()):
        start = data.draw(st.integers(0, len(full) - 1))
        stops.append(full[start : start + data.draw(st.integers(1, 5))])
    params = SamplingParams(stop=stops or None, include_stop_str_in_output=include)
    deltas, matched, detok = stream(tokenizer, params, ids, chunks=chunks)
    expected_text, expected_stop = expected_cut(full, stops, include)
    assert "".join(deltas) == detok.text == expected_text
    assert matched == expected_stop


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data(), skip=st.booleans())
def test_any_token_sequence_concatenates_to_decode(tokenizer, data: st.DataObject, skip: bool) -> None:
    # Random ids include stray UTF-8 bytes and special tokens: the stream must still equal decode.
    # Not byte-fallback tokens: their decoder turns a whole run of bytes into U+FFFD once any byte in it
    # is invalid, rewriting text already decoded, which no stream can take back.
    vocab = [i for t, i in tokenizer.get_vocab().items() if not (t.startswith("<0x") and t.endswith(">"))]
    ids = data.draw(st.lists(st.sampled_from(sorted(vocab)), max_size=25))
    chunks = data.draw(st.lists(st.integers(1, 3), max_size=25))
    deltas, _, detok = stream(tokenizer, SamplingParams(skip_special_tokens=skip), ids, chunks=chunks)
    assert "".join(deltas) == detok.text == decode(tokenizer, ids, skip_special_tokens=skip)
