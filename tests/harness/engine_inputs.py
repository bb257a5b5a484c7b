"""Inputs for engine tests: random prompts, and adapters loaded into the host tier up front."""

from __future__ import annotations

import random
from pathlib import Path

from base_engine.engine import LLMEngine


def random_prompts(num: int, vocab: int, lo: int, hi: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    # Token ids >= 3 keep clear of the special tokens (bos/eos) at the bottom of the tiny vocab.
    return [[rng.randrange(3, vocab) for _ in range(rng.randint(lo, hi))] for _ in range(num)]


def preload_adapters(engine: LLMEngine, adapter_dirs: list[Path], timeout_s: float = 120.0) -> None:
    """Adapters in the host tier up front: an engine step while a load runs in the background does
    nothing, so without this the number of steps a scenario takes follows the machine's load."""
    cache = engine.lora.cache
    for path in adapter_dirs:
        cache.request_load(engine.lora.local_ref(path))
    for pending in list(cache.pending.values()):
        pending.future.result(timeout=timeout_s)
    cache.poll()
