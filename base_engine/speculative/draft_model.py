"""Draft-model proposer (``speculative="draft:<dir>"``): a smaller checkpoint with the target's
tokenizer drafts k tokens greedily; the engine's verify path accepts only what the target samples
anyway, so the output is the same with or without it (a bad drafter costs acceptance, never tokens).

The drafter is unadapted and shared by every tenant. It runs dense, outside the paged KV pool: each
step recomputes its K/V over the request's whole context (one prefill of prompt + output, then k - 1
one-token steps on a cache that lives for that call only). Simple and stateless (preemption, aborts
and rejected drafts need no rollback), at the cost of O(context) drafter work per request per step.
It is loaded through ``transformers`` in float32 on the engine's device, after our own config parser
has accepted the architecture.

Refused by name at start: an architecture we do not serve, a vocab size or tokenizer vocabulary that
differs from the target's (drafted ids would mean other tokens).
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, PreTrainedTokenizerBase

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

    @torch.inference_mode()
    def propose(self, tokens: Sequence[int], k: int) -> list[int]:
        """Up to k greedy drafter tokens after ``tokens`` (fewer near the drafter's context limit)."""
        k = min(k, self.max_positions - len(tokens))
        if k <= 0:
            return []
        ids = torch.tensor([list(tokens)], dtype=torch.long, device=self.device)
        out = self.model(input_ids=ids, use_cache=True, logits_to_keep=1)  # the last row only
        drafts = [int(out.logits[0, -1].argmax())]
        while len(drafts) < k:
            step = torch.tensor([[drafts[-1]]], dtype=torch.long, device=self.device)
            out = self.model(input_ids=step, cache=out.cache, use_cache=True)
            drafts.append(int(out.logits[0, -1].argmax()))
        return drafts
