"""Offline front door: `LLM(model_dir).generate(prompts, sampling_params, adapters)`."""

from __future__ import annotations

import dataclasses
import itertools
import time
from collections.abc import Sequence as Seq
from pathlib import Path

import torch

from adapters.types import AdapterRef
from base_engine.engine import LLMEngine
from base_engine.engine_config import EngineConfig
from base_engine.outputs import RequestOutput
from base_engine.sampling_params import SamplingParams


class LLM:
    def __init__(
        self,
        model: str | Path,
        *,
        device: str = "cpu",
        dtype: str | torch.dtype = "float32",
        **engine_options: object,
    ) -> None:
        self.engine = LLMEngine(
            model, device=device, dtype=dtype, config=EngineConfig.from_options(**engine_options)
        )
        self._ids = itertools.count()

    def close(self) -> None:
        """Release the engine this LLM owns (its adapter loader's threads); generate nothing after."""
        self.engine.close()

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    @property
    def tokenizer(self):  # noqa: ANN201 - a transformers tokenizer
        return self.engine.tokenizer

    def generate(
        self,
        prompts: Seq[str] | Seq[list[int]] | str,
        sampling_params: SamplingParams | Seq[SamplingParams] | None = None,
        adapters: Seq[str | Path | None] | None = None,
    ) -> list[RequestOutput]:
        """Runs the prompts to completion; outputs come back in prompt order.

        Every request is validated before any is queued, so a bad one raises ValueError and runs nothing.
        """
        if isinstance(prompts, str):
            prompts = [prompts]
        num = len(prompts)
        params = self._broadcast("sampling_params", sampling_params or SamplingParams(), num)
        refs = self._adapter_refs(adapters, num)
        encoded = [self.engine.encode_prompt(p) for p in prompts]
        for i, (ids, p) in enumerate(zip(encoded, params, strict=True)):
            try:
                self.engine.validate(ids, p)
            except ValueError as exc:
                raise ValueError(f"prompt {i}: {exc}") from None
        request_ids = [f"offline-{next(self._ids)}" for _ in range(num)]
        for rid, ids, p, ref in zip(request_ids, encoded, params, refs, strict=True):
            self.engine.add_request(rid, ids, p, adapter=ref)
        finished: dict[str, RequestOutput] = {}
        while len(finished) < num:
            num_steps = self.engine.num_steps
            outputs = self.engine.step()
            for out in outputs:
                if out.finished:
                    finished[out.request_id] = out
            if self.engine.num_steps == num_steps and not outputs:
                time.sleep(0.001)  # nothing runnable yet: adapters are loading in the background
        return [finished[rid] for rid in request_ids]

    @staticmethod
    def _broadcast(name: str, value: SamplingParams | Seq[SamplingParams], num: int) -> list[SamplingParams]:
        values = [value] * num if isinstance(value, SamplingParams) else list(value)
        if len(values) != num:
            raise ValueError(
                f"{name} has {len(values)} entries for {num} prompts; give one or one per prompt"
            )
        # A grammar constraint holds one request's state: each prompt gets its own copy.
        seen: set[int] = set()
        for i, p in enumerate(values):
            if p.constraint is not None and id(p) in seen:
                values[i] = dataclasses.replace(p, constraint=p.constraint.fork())
            seen.add(id(p))
        return values

    def _adapter_refs(self, adapters: Seq[str | Path | None] | None, num: int) -> list[AdapterRef | None]:
        if adapters is None:
            return [None] * num
        entries = list(adapters)
        if len(entries) != num:
            raise ValueError(f"adapters has {len(entries)} entries for {num} prompts; give one per prompt")
        return [None if a is None else self.engine.lora.local_ref(Path(a)) for a in entries]
