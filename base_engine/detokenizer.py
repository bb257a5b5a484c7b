"""Incremental detokenization with stop strings, for streaming one request's output.

Follows the prefix-offset / read-offset scheme of Hugging Face's TextStreamer and vLLM's
``detokenize_incrementally``: each step decodes only a short window of recent token ids twice (the
already-read part and the whole window) and appends the difference, so the cost per token does not
grow with the output and the text is what a full ``tokenizer.decode`` gives.

- A window whose text ends in U+FFFD stops at an incomplete UTF-8 character (a byte-level BPE or
  byte-fallback token that holds only some of its bytes); it stays unread until the character is whole.
- The window starts a few tokens before the read position so that tokenizers which drop the leading
  space of a decoded text (sentencepiece's Metaspace) still give the space at the boundary.
- Stop strings are matched by one automaton per request (base_engine/stop_strings.py) that reads each
  new character once, however many stops there are, so they match across token boundaries; streamed
  text holds back any tail that may still grow into one. As vLLM's detokenizer, a stop string ends the
  request only once more than ``min_tokens`` tokens were generated; the text read before is still fed to
  the automaton, so a stop that spans the boundary matches.

``spaces_between_special_tokens`` (vLLM's option, default true) is the text the tokenizer's own
decoder writes; false (with special tokens kept) writes an added token that follows another added
token as its bare content, without the space a decoder such as WordPiece puts between tokens, as
vLLM's fast incremental detokenizer does. Byte-level BPE and Metaspace decoders put no space there.

Text once decoded is never taken back. A byte-fallback decoder (``<0xNN>`` tokens) that meets an
invalid run of bytes turns the whole run into U+FFFD, rewriting characters decoded before; only for
such invalid output can the stream differ from a full decode.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from functools import partial
from typing import Protocol

from transformers import PreTrainedTokenizerFast

from base_engine.sampling_params import SamplingParams

# Tokens before the read position that are decoded again as context (vLLM uses 5 too).
_PREFIX_CONTEXT_TOKENS = 5
_REPLACEMENT_CHAR = "\ufffd"


class Tokenizer(Protocol):
    """The part of a Hugging Face tokenizer used here."""

    def decode(self, token_ids: list[int], **kwargs: bool) -> str: ...


def _decoder(tokenizer: Tokenizer, skip_special_tokens: bool) -> Callable[[list[int]], str]:
    """``ids -> text`` exactly as ``tokenizer.decode`` without the clean-up of spaces."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is not None and getattr(type(tokenizer), "_decode", None) is PreTrainedTokenizerFast._decode:
        # What the fast tokenizer's decode calls; skipping the Python layers around it is ~10x faster
        # and this runs twice per request per step.
        return partial(backend.decode, skip_special_tokens=skip_special_tokens)
    return partial(
        tokenizer.decode, skip_special_tokens=skip_special_tokens, clean_up_tokenization_spaces=False
    )


class Detokenizer:
    def __init__(
        self, tokenizer: Tokenizer, params: SamplingParams, prompt_token_ids: Sequence[int] = ()
    ) -> None:
        self._decode = _decoder(tokenizer, params.skip_special_tokens)
        self._stops = params.stop_automaton  # None without stop strings
        self._stop_state = 0  # where the text read so far leaves the automaton
        self._include_stop = params.include_stop_str_in_output
        self._min_tokens = params.min_tokens
        self._num_output = 0  # output tokens given to update()
        # Prompt ids are kept only as decoding context for the first output tokens.
        self._token_ids: list[int] = list(prompt_token_ids[-_PREFIX_CONTEXT_TOKENS:])
        self._prefix_offset = 0  # window start: context decoded again each step
        self._read_offset = len(self._token_ids)  # ids before this are already in the text
        self._chunks: list[str] = []  # the output text, in pieces (joined lazily by `text`)
        self._num_chars = 0
        self._unsent: list[str] = []  # text not yet returned by take_delta
        self._stop: str | None = None
        # spaces_between_special_tokens=False: added token id -> content; None when the decoder's text is kept
        self._added: dict[int, str] | None = None
        if not params.spaces_between_special_tokens and not params.skip_special_tokens:
            decoder = getattr(tokenizer, "added_tokens_decoder", {})
            self._added = {token_id: token.content for token_id, token in decoder.items()}
        self._is_last_added = False  # the previous output token is an added token

    @property
    def text(self) -> str:
        """Output text so far, cut at a matched stop string (kept only with include_stop_str_in_output).

        An incomplete UTF-8 character at the end is not in it until it completes or take_delta(is_final=True).
        """
        if len(self._chunks) > 1:
            self._chunks = ["".join(self._chunks)]
        return self._chunks[0] if self._chunks else ""

    @property
    def stop_reason(self) -> str | None:
        """The stop string that matched, or None."""
        return self._stop

    def update(self, new_token_ids: Sequence[int]) -> str | None:
        """Appends generated tokens; returns the stop string that matched, else None."""
        if self._stop is not None:
            raise RuntimeError(f"update() after stop string {self._stop!r} matched: the request has finished")
        self._token_ids.extend(new_token_ids)
        self._num_output += len(new_token_ids)
        bare = self._bare_added(new_token_ids)
        window_text, read_text = self._decode_window()
        if bare is None and (window_text.endswith(_REPLACEMENT_CHAR) or len(window_text) <= len(read_text)):
            return None  # an incomplete character (or nothing new yet): wait for more tokens
        self._advance()
        return self._append(window_text[len(read_text) :] if bare is None else bare)

    def _bare_added(self, new_token_ids: Sequence[int]) -> str | None:
        """With spaces_between_special_tokens=False: the content of an added token that follows another
        (written without the decoder's space before it), else None."""
        if self._added is None:
            return None
        content = self._added.get(new_token_ids[-1]) if len(new_token_ids) == 1 else None
        is_after_added = self._is_last_added
        self._is_last_added = content is not None
        return content if content is not None and is_after_added else None

    def take_delta(self, *, is_final: bool = False) -> str:
        """New text safe to stream since the last call.

        Holds back the end of the text that may still grow into a stop string; ``is_final`` releases
        it together with an incomplete trailing character (as U+FFFD, like ``tokenizer.decode``).
        """
        if is_final and self._stop is None and len(self._token_ids) > self._read_offset:
            window_text, read_text = self._decode_window()
            self._advance()
            self._append(window_text[len(read_text) :])
        unsent = "".join(self._unsent)
        hold = 0 if is_final or self._stop is not None else self._num_held(unsent)
        delta, kept = unsent[: len(unsent) - hold], unsent[len(unsent) - hold :]
        self._unsent = [kept] if kept else []
        return delta

    def _decode_window(self) -> tuple[str, str]:
        """Text of the whole window and of its already-read part."""
        window = self._token_ids[self._prefix_offset :]
        return self._decode(window), self._decode(window[: self._read_offset - self._prefix_offset])

    def _advance(self) -> None:
        # The newly read tokens become the next window's context; older ids are no longer needed,
        # which keeps memory and every decode bounded.
        del self._token_ids[: self._read_offset]
        self._prefix_offset, self._read_offset = 0, len(self._token_ids)

    def _append(self, new_text: str) -> str | None:
        """Adds decoded text, then cuts it at the first stop string that the new text completes."""
        if self._stops is None:
            self._push(new_text)
            return None
        self._stop_state, match = self._stops.feed(self._stop_state, new_text)
        while match is not None and self._num_output <= self._min_tokens:  # too early: read on past it
            start = match.end
            self._stop_state, match = self._stops.feed(self._stop_state, new_text[start:])
            match = None if match is None else match._replace(end=start + match.end)
        if match is None:
            self._push(new_text)
            return None
        # The stop that ends first is the one a token-by-token stream would have met first.
        cut = match.end if self._include_stop else match.end - len(match.stop)  # position in new_text
        if cut >= 0:
            self._push(new_text[:cut])
        else:
            self._drop(-cut)  # the stop began in text appended earlier
        self._stop = match.stop
        return match.stop

    def _push(self, piece: str) -> None:
        if piece:
            self._chunks.append(piece)
            self._unsent.append(piece)
            self._num_chars += len(piece)

    def _drop(self, num_chars: int) -> None:
        """Removes the last ``num_chars`` characters (never streamed: they were held back)."""
        text = self.text[: self._num_chars - num_chars]
        unsent = "".join(self._unsent)
        self._chunks = [text]
        self._unsent = [unsent[: len(unsent) - num_chars]]
        self._num_chars -= num_chars

    def _num_held(self, unsent: str) -> int:
        """Length of the longest end of the text that is a proper prefix of some stop string (never more
        than is unsent: what was held back before is still unsent)."""
        return 0 if self._stops is None else min(self._stops.num_held(self._stop_state), len(unsent))
