"""A lower bound on a text's token count, from its length alone: a prompt that cannot fit the context
is refused before the tokenizer spends seconds of CPU on it.

Measured: SmolLM2's tokenizer takes ~11 s of CPU for an 8 MiB prompt (the request body limit), and a
prompt that long is refused anyway (its 8192-token context holds ~0.6 MB of text at most). Encoding
runs on a worker thread but still takes a core from the engine and from every other request.

The bound: no token covers more text than its longest vocabulary entry. Byte-level BPE (Llama 3,
SmolLM2, GPT-2) writes each byte as one character of its vocabulary, and a text's characters are at
most its bytes; SentencePiece-style tokenizers write the characters themselves (`▁` for a space,
byte-fallback entries `<0x..>` longer than the byte they stand for). So `tokens >= chars / K` for the
longest entry's length K. That holds only while nothing upstream of the model shortens the text; a
tokenizer that might is given no bound (`None`), never a wrong one:
- normalizers other than Prepend and a Replace of a fixed string by one at least as long (NFC and NFKC
  compose characters, Strip removes them, ...);
- pre-tokenizers that drop text (Whitespace, a Split that removes its matches, ...);
- models other than BPE, and BPE that fuses runs of unknown characters into one token (unless every
  byte falls back to a byte entry, as in Llama 2);
- added tokens that absorb the whitespace next to them (`lstrip` / `rstrip`).
"""

from __future__ import annotations

import json
import logging
import weakref
from typing import Any

logger = logging.getLogger(__name__)

_SAFE_PRE_TOKENIZERS = {"ByteLevel", "Metaspace", "Digits", "Punctuation"}
_KNOWN: weakref.WeakKeyDictionary[Any, int | None] = weakref.WeakKeyDictionary()


def max_chars_per_token(tokenizer: Any) -> int | None:
    """The most characters of input one token can cover, or None when this tokenizer has no sound
    bound. Computed once per tokenizer object (a parse of its tokenizer.json)."""
    try:
        return _KNOWN[tokenizer]
    except KeyError:
        pass
    try:
        spec = json.loads(tokenizer.backend_tokenizer.to_str())
        reason = _unsound(spec)
        bound = None if reason else _longest_entry(spec)
    except (AttributeError, KeyError, TypeError, ValueError) as exc:
        reason, bound = f"cannot read its definition ({exc})", None
    if reason:
        logger.info("no length bound for this tokenizer's prompts: %s", reason)
    _KNOWN[tokenizer] = bound
    return bound


def least_tokens(tokenizer: Any, text: str) -> int:
    """A count `text` cannot encode to fewer tokens than (0 when the tokenizer has no bound)."""
    bound = max_chars_per_token(tokenizer)
    return 0 if bound is None else -(-len(text) // bound)


def _unsound(spec: dict[str, Any]) -> str | None:
    """Why a text might encode to fewer tokens than chars / K, or None."""
    if (why := _normalizer_shortens(spec.get("normalizer"))) is not None:
        return f"its normalizer {why}"
    if (why := _pre_tokenizer_drops(spec.get("pre_tokenizer"))) is not None:
        return f"its pre-tokenizer {why}"
    model = spec.get("model") or {}
    if model.get("type") != "BPE":
        return f"its model is {model.get('type')}, not BPE"
    if model.get("fuse_unk") and model.get("unk_token") is not None and not _falls_back_to_bytes(model):
        return "it fuses runs of unknown characters into one token"
    for added in spec.get("added_tokens") or []:
        if added.get("lstrip") or added.get("rstrip"):
            return f"its added token {added.get('content')!r} absorbs the whitespace beside it"
    return None


def _falls_back_to_bytes(model: dict[str, Any]) -> bool:
    """Byte fallback with every byte in the vocabulary: no character is ever unknown (Llama 2)."""
    vocab = model.get("vocab") or {}
    return bool(model.get("byte_fallback")) and all(f"<0x{b:02X}>" in vocab for b in range(256))


def _normalizer_shortens(node: dict[str, Any] | None) -> str | None:
    if node is None:
        return None
    kind = node.get("type")
    if kind == "Sequence":
        return next((w for n in node.get("normalizers", []) if (w := _normalizer_shortens(n))), None)
    if kind == "Prepend":
        return None
    if kind == "Replace":
        pattern = (node.get("pattern") or {}).get("String")
        if pattern is not None and len(node.get("content", "")) >= len(pattern):
            return None
    return f"{kind} may shorten the text"


def _pre_tokenizer_drops(node: dict[str, Any] | None) -> str | None:
    if node is None:
        return None
    kind = node.get("type")
    if kind == "Sequence":
        return next((w for n in node.get("pretokenizers", []) if (w := _pre_tokenizer_drops(n))), None)
    if kind in _SAFE_PRE_TOKENIZERS:
        return None
    if kind == "Split" and node.get("behavior") != "Removed":
        return None
    return f"{kind} may drop text"


def _longest_entry(spec: dict[str, Any]) -> int:
    vocab = spec["model"]["vocab"]
    added = [t["content"] for t in spec.get("added_tokens") or []]
    return max(1, *(len(entry) for entry in vocab), *(len(entry) for entry in added))
