"""Draft-model proposer (``speculative="draft:<dir>"``): a smaller checkpoint with the target's
tokenizer drafts k tokens greedily; the engine's verify path accepts only what the target samples
anyway, so the output is the same with or without it (a bad drafter costs acceptance, never tokens).

The drafter is unadapted and shared by every tenant. It runs dense, outside the paged KV pool, with a
KV cache of its own per request (``transformers``' DynamicCache) and the tokens that cache holds: a
step crops the cache back to the longest common prefix of those tokens and the request's current
ones (rolling back the rejected drafts) and runs only the tokens after it (the accepted drafts and
the sampled token), then k - 1 one-token steps. The cache is keyed by request id and released when
the request leaves the running set (finished, aborted, preempted: a recomputed request starts a new
one); a cache that cannot be cropped exactly (sliding-window layers) is rebuilt from the whole
context. It is loaded through ``transformers`` in float32 on the engine's device, after our own
config parser has accepted the architecture.

Refused by name at start: an architecture we do not serve, a vocab size or tokenizer vocabulary that
differs from the target's (drafted ids would mean other tokens).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, Cache, PreTrainedTokenizerBase

from base_engine.model.config import ModelConfig, load_model_config
from base_engine.model.tokenizer import load_tokenizer

PREFIX = "draft:"


def draft_dir(method: str) -> Path | None:
    """The drafter's directory of a ``draft:<dir>`` method, else None."""
    return Path(method[len(PREFIX) :]) if method.startswith(PREFIX) else None


def check_drafter(
    path: Path, config: ModelConfig, tokenizer: PreTrainedTokenizerBase, target: ModelConfig, target_tok
) -> None:
    if config.vocab_size != target.vocab_size:
        raise ValueError(
            f"draft model {path} has vocab_size {config.vocab_size}, the target model "
            f"{target.vocab_size}: a drafter must share the target's tokenizer and vocabulary"
        )
    if tokenizer.get_vocab() != target_tok.get_vocab():
        raise ValueError(
            f"draft model {path} has another tokenizer vocabulary than the target model: "
            f"a drafter must share the target's tokenizer"
        )


@dataclass(slots=True)
class DraftCache:
    """One request's drafter K/V and the tokens they were computed for, in order."""

    tokens: list[int]
    cache: Cache


def common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    n = min(len(a), len(b))
    for i in range(n):
        if a[i] != b[i]:
            return i
    return n


class DraftModelProposer:
    def __init__(
        self,
        path: str | Path,
        target: ModelConfig,
        target_tokenizer: PreTrainedTokenizerBase,
        *,
        device: torch.device,
    ) -> None:
        self.path = Path(path)
        if not self.path.is_dir():
            raise ValueError(f"draft model {self.path} is not a directory (speculative='draft:<dir>')")
        config = load_model_config(self.path)  # refuses architectures we do not serve, by name
        check_drafter(self.path, config, load_tokenizer(self.path), target, target_tokenizer)
        self.max_positions = config.max_position_embeddings
        self.device = device
        model = AutoModelForCausalLM.from_pretrained(self.path, dtype=torch.float32)
        self.model = model.to(device).eval()
        self.use_cache = True  # False: every step recomputes the whole context (the test's oracle)
        self.caches: dict[str, DraftCache] = {}  # per running request id
        self.num_tokens_run = 0  # drafter tokens computed, all requests (what the cache saves)

    def release(self, request_id: str) -> None:
        self.caches.pop(request_id, None)

    @torch.inference_mode()
    def propose(self, request_id: str, tokens: Sequence[int], k: int) -> list[int]:
        """Up to k greedy drafter tokens after ``tokens`` (fewer near the drafter's context limit)."""
        k = min(k, self.max_positions - len(tokens))
        if k <= 0:
            return []
        cache, start = self._resume(request_id, tokens)
        ids = torch.tensor([list(tokens[start:])], dtype=torch.long, device=self.device)
        out = self.model(input_ids=ids, cache=cache, use_cache=True, logits_to_keep=1)  # last row only
        self.num_tokens_run += len(tokens) - start
        drafts = [int(out.logits[0, -1].argmax())]
        while len(drafts) < k:
            step = torch.tensor([[drafts[-1]]], dtype=torch.long, device=self.device)
            out = self.model(input_ids=step, cache=out.cache, use_cache=True)
            self.num_tokens_run += 1
            drafts.append(int(out.logits[0, -1].argmax()))
        if self.use_cache:  # it holds tokens + every draft but the last (never run)
            self.caches[request_id] = DraftCache(list(tokens) + drafts[:-1], out.cache)
        return drafts

    def _resume(self, request_id: str, tokens: Sequence[int]) -> tuple[Cache | None, int]:
        """The request's cache cropped to what still holds for ``tokens`` and where to go on from
        (at least the last token runs again: its logits give the first draft); (None, 0): afresh."""
        entry = self.caches.pop(request_id, None)
        if entry is None or not entry.cache.is_croppable:
            return None, 0
        keep = min(common_prefix(entry.tokens, tokens), len(tokens) - 1)
        if keep == 0:
            return None, 0
        if len(entry.tokens) > keep:  # the rejected drafts (and a rerun last token) roll back
            entry.cache.crop(keep - len(entry.tokens))  # transformers 5: a negative count to remove
        return entry.cache, keep
