"""Device-correct by construction, checked without a GPU: the engine runs on the `meta` device under a
guard that refuses any tensor reaching the model, attention or `add_lora` from another device and any
read back to the host (`item`, `tolist`, `bool`), which on CUDA would be a mismatch error or a sync.

A step's host work (scheduling, building metadata) runs outside the guard; `execute` runs inside it.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_flatten

from adapters.testing import save_random_adapter
from base_engine import SamplingParams
from base_engine.engine import LLMEngine
from base_engine.engine_config import EngineConfig
from base_engine.model.config import load_model_config
from tests.harness.families import CHECKPOINTS

HOST_READS = {
    torch.Tensor.item,
    torch.Tensor.tolist,
    torch.Tensor.__bool__,
    torch.Tensor.cpu,
    torch.Tensor.numpy,
}


class DeviceGuard(TorchFunctionMode):
    def __init__(self, device: torch.device) -> None:
        super().__init__()
        self.device = device
        self.num_calls = 0

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        self.num_calls += 1
        if func in HOST_READS:
            raise AssertionError(f"host read inside the step: {func.__name__}")
        for value in tree_flatten((args, kwargs))[0]:
            if isinstance(value, torch.Tensor) and value.device != self.device and value.dim() > 0:
                raise AssertionError(f"{getattr(func, '__name__', func)} got a tensor on {value.device}")
        return func(*args, **kwargs)


# Llama, and Gemma's per-layer windows, local RoPE and soft-capped attention.
@pytest.fixture(scope="module", params=["llama-gqa", "gemma2-softcap", "gemma3-window"])
def meta_engine(
    request: pytest.FixtureRequest, make_checkpoint, tmp_path_factory: pytest.TempPathFactory
) -> tuple[LLMEngine, list]:
    model_dir: Path = make_checkpoint(**CHECKPOINTS[request.param])
    base = load_model_config(model_dir).base_shapes()
    root = tmp_path_factory.mktemp("guard")
    adapters = [save_random_adapter(root / f"a{i}", base, rank=4, seed=i) for i in range(2)]
    config = EngineConfig(num_kv_blocks=32, block_size=4, max_num_batched_tokens=12, max_loras=2)
    engine = LLMEngine(model_dir, device="meta", config=config)
    refs = [engine.lora.local_ref(a) for a in adapters]
    for ref in refs:
        engine.lora.cache.request_load(ref)
    for pending in list(engine.lora.cache.pending.values()):
        pending.future.result(timeout=30)
    engine.lora.cache.poll()
    return engine, refs


def test_steps_touch_only_the_engine_device(meta_engine) -> None:
    engine, refs = meta_engine
    params = SamplingParams(max_tokens=4, ignore_eos=True)
    for i, ref in enumerate([None, refs[0], refs[1], refs[0]]):
        engine.add_request(f"r{i}", list(range(5 + i, 12 + 2 * i)), params, adapter=ref)
    guard = DeviceGuard(engine.device)
    kinds = set()
    for _ in range(6):  # chunked prefills, then decodes next to prefill chunks with context
        sched = engine.scheduler.schedule()
        batch = engine.runner.prepare(sched)
        engine.runner.clear_blocks(engine.block_manager.take_fresh_blocks())
        lora = engine.lora.prepare_step(batch.row_slots)
        with guard:
            result = engine.runner.execute(batch, lora)
        assert result.logits.device == engine.device and result.logits.shape[0] == len(batch.sampled)
        kinds |= {"decode" if batch.meta.decode_buckets else "", "prefill" if batch.meta.prefills else ""}
        kinds |= {"lora"} if lora is not None else set()
        for item in sched.scheduled:  # what the sampler would do, without values
            item.seq.num_computed_tokens += item.num_new_tokens
            if item.is_sampled:
                item.seq.output_token_ids.append(7)
    assert {"decode", "prefill", "lora"} <= kinds and guard.num_calls > 100


def test_guard_catches_a_host_tensor_and_a_host_read() -> None:
    guard = DeviceGuard(torch.device("meta"))
    x = torch.zeros(3, device="meta")
    with pytest.raises(AssertionError, match="got a tensor on cpu"), guard:
        torch.add(x, torch.ones(3))
    with pytest.raises(AssertionError, match="host read"), guard:
        torch.ones(2).tolist()
