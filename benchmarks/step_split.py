"""Where an engine step's time goes, by op: timed hooks on the model's modules and the step's calls.

`StepSplit(engine)` is a context manager that, while open, times every call of the pieces below and
books each call's *exclusive* time (its own, less the timed calls nested inside it) to a category:

    gemm       every nn.Linear forward, and the LM head (`decoder._head`, vocabulary-chunked on CPU)
    attention  `attend`, the K/V cache write (`write_kv`) and the rest of the Attention module
               (q/k/v split and views) less its linears
    rope       `apply_rope` on q and k
    norms      RMSNorm / GemmaRMSNorm forwards
    activation the dense MLP less its linears (SiLU/GELU times up)
    residual   a decoder layer less its parts (the two residual adds)
    moe        a SparseMoeBlock less its linears (routing, expert loop; MoE models only)
    lora       the LoRA step metadata (`lora.prepare_step`) and every `LoraStepBatch` call
    sampler    the engine's sampler
    schedule   the scheduler's `schedule()`
    prepare    the runner's `prepare` (step tensors and attention metadata)
    model      the rest of `runner.execute`: embedding, RoPE table lookup, row gather, finiteness checks
    python     the rest of `engine.step`: bookkeeping, appending tokens, outputs

It also records every GEMM call it saw (the module or head weight, input shape and dtype), so that
`replay_gemms` can run the same GEMMs alone, through the same torch calls, as the bound to compare
the step with. Timing hooks cost ~1 us per call; the step without hooks is timed separately.
"""

from __future__ import annotations

import time
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

import base_engine.lora as lora_module
import base_engine.model.decoder as decoder
from base_engine.model.gemma import GemmaDecoderLayer, GemmaRMSNorm
from base_engine.model.moe import SparseMoeBlock

CATEGORIES = ("gemm", "attention", "rope", "norms", "activation", "residual", "moe", "lora", "sampler",
              "schedule", "prepare", "model", "python")  # fmt: skip
# Module classes -> category (exclusive of the timed modules and calls inside them).
_MODULES: tuple[tuple[type, str], ...] = (
    (nn.Linear, "gemm"),
    (decoder.RMSNorm, "norms"),
    (GemmaRMSNorm, "norms"),
    (decoder.Attention, "attention"),
    (decoder.MLP, "activation"),
    (SparseMoeBlock, "moe"),
    (decoder.DecoderLayer, "residual"),
    (GemmaDecoderLayer, "residual"),
)
_LORA_METHODS = ("apply", "add_embedding", "add_lm_head", "head_groups", "replace_embedding",
                 "apply_norm", "experts")  # fmt: skip


@dataclass(frozen=True)
class GemmCall:
    """One GEMM of a step: `linear` (an nn.Linear) or the LM head `weight`, on an input of `shape`."""

    shape: tuple[int, ...]
    dtype: torch.dtype
    linear: nn.Linear | None = None
    weight: torch.Tensor | None = None
    invariant: bool = False


class StepSplit:
    """Exclusive seconds per category over the steps run while open (`seconds`), and the GEMM calls
    of the last step (`gemms`)."""

    def __init__(self, engine: Any) -> None:
        self.engine = engine
        self.seconds: dict[str, float] = defaultdict(float)
        self.num_steps = 0
        self.gemms: list[GemmCall] = []
        self._stack: list[list] = []  # [category, start, seconds of timed calls nested inside]
        self._undo: list[Callable[[], None]] = []
        self._recording = False  # GEMM calls are recorded during `step` only

    # ---- timing ---------------------------------------------------------------------------------

    def _enter(self, category: str) -> None:
        self._stack.append([category, time.perf_counter(), 0.0])

    def _exit(self) -> float:
        category, start, nested = self._stack.pop()
        elapsed = time.perf_counter() - start
        self.seconds[category] += elapsed - nested
        if self._stack:
            self._stack[-1][2] += elapsed
        return elapsed

    def _timed(self, category: str, fn: Callable) -> Callable:
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            self._enter(category)
            try:
                return fn(*args, **kwargs)
            finally:
                self._exit()

        return wrapper

    # ---- installing / removing the hooks --------------------------------------------------------

    def _patch(self, owner: Any, name: str, new: Any) -> None:
        """owner.name = new until exit (a bound method shadowed on an instance is simply deleted)."""
        if name in vars(owner):
            old = vars(owner)[name]
            self._undo.append(lambda: setattr(owner, name, old))
        else:
            self._undo.append(lambda: delattr(owner, name))
        setattr(owner, name, new)

    def _hook_module(self, module: nn.Module, category: str) -> None:
        def pre(mod: nn.Module, args: tuple) -> None:
            self._enter(category)
            if category == "gemm":
                x = args[0]
                self._record(GemmCall(tuple(x.shape), x.dtype, linear=mod))

        def post(mod: nn.Module, args: tuple, out: Any) -> None:
            self._exit()

        handles = (module.register_forward_pre_hook(pre), module.register_forward_hook(post))
        self._undo += [h.remove for h in handles]

    def _record(self, call: GemmCall) -> None:
        if self._recording:
            self.gemms.append(call)

    def __enter__(self) -> StepSplit:
        engine = self.engine
        for module in engine.runner.model.modules():
            category = next((c for cls, c in _MODULES if isinstance(module, cls)), None)
            if category is not None:
                self._hook_module(module, category)
        head = decoder._head

        def timed_head(hidden: torch.Tensor, weight: torch.Tensor, invariant: bool) -> torch.Tensor:
            self._record(GemmCall(tuple(hidden.shape), hidden.dtype, weight=weight, invariant=invariant))
            return self._timed("gemm", head)(hidden, weight, invariant)

        self._patch(decoder, "_head", timed_head)
        for name, category in (("attend", "attention"), ("write_kv", "attention"), ("apply_rope", "rope")):
            self._patch(decoder, name, self._timed(category, getattr(decoder, name)))
        for name in _LORA_METHODS:
            method = lora_module.LoraStepBatch.__dict__[name]
            self._patch(lora_module.LoraStepBatch, name, self._timed("lora", method))
        self._patch(engine.lora, "prepare_step", self._timed("lora", engine.lora.prepare_step))
        self._patch(engine, "sampler", self._timed("sampler", engine.sampler))
        self._patch(engine.scheduler, "schedule", self._timed("schedule", engine.scheduler.schedule))
        self._patch(engine.runner, "prepare", self._timed("prepare", engine.runner.prepare))
        self._patch(engine.runner, "execute", self._timed("model", engine.runner.execute))
        return self

    def __exit__(self, *exc: object) -> None:
        for undo in reversed(self._undo):
            undo()
        self._undo.clear()

    def step(self) -> float:
        """One engine step under the hooks (its GEMMs recorded in `gemms`); returns its seconds."""
        self.gemms = []
        self._recording = True
        self._enter("python")
        try:
            self.engine.step()
        finally:
            elapsed = self._exit()
            self._recording = False
        self.num_steps += 1
        return elapsed

    def per_step_ms(self) -> dict[str, float]:
        return {c: round(1000 * self.seconds.get(c, 0.0) / max(self.num_steps, 1), 3) for c in CATEGORIES}


def gemm_inputs(gemms: list[GemmCall], seed: int = 0) -> list[torch.Tensor]:
    """Random inputs of each call's shape and dtype (scaled like a normed hidden state)."""
    generator = torch.Generator().manual_seed(seed)
    return [torch.randn(c.shape, generator=generator).to(c.dtype) for c in gemms]


@torch.inference_mode()
def replay_gemms(gemms: list[GemmCall], inputs: list[torch.Tensor]) -> float:
    """Seconds to run the step's GEMMs alone, in the step's order, through the same calls."""
    start = time.perf_counter()
    for call, x in zip(gemms, inputs, strict=True):
        if call.linear is not None:
            call.linear(x)
        else:
            decoder._head(x, call.weight, call.invariant)
    return time.perf_counter() - start
