"""The engine on CUDA (skipped without a GPU; run by benchmarks/gpu_check.sh): the oracle against
transformers in bf16 on Llama / Mistral (sliding window) / Qwen2, and CUDA-graph decode replayed with
changing batch sizes and adapter sets, bitwise equal to the eager engine."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from adapters.testing import save_random_adapter
from base_engine import LLM, SamplingParams
from base_engine.engine import LLMEngine
from base_engine.engine_config import EngineConfig
from base_engine.model.config import load_model_config
from tests.base_engine.oracle import assert_greedy_match
from tests.harness.engine_inputs import random_prompts

pytestmark = pytest.mark.gpu

VARIANTS = {
    "llama": {"arch": "llama"},
    "mistral-window": {"arch": "mistral", "seed": 5, "sliding_window": 12},
    "qwen2": {"arch": "qwen2", "seed": 2},
}
MAX_NEW = 12


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_cuda_bf16_greedy_matches_transformers(variant: str, make_checkpoint) -> None:
    from transformers import AutoModelForCausalLM

    model_dir = make_checkpoint(**VARIANTS[variant])
    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.bfloat16).cuda().eval()
    llm = LLM(model_dir, device="cuda", dtype="bfloat16", num_kv_blocks=64, block_size=16)
    assert llm.engine.runner.use_paged and llm.engine.graphs is not None
    prompts = random_prompts(4, 500, 3, 40, seed=len(variant))
    params = SamplingParams(temperature=0.0, max_tokens=MAX_NEW, logprobs=5, ignore_eos=True)
    compared = 0
    for prompt, out in zip(prompts, llm.generate(prompts, params), strict=True):
        ids = torch.tensor([prompt], device="cuda")
        ref_tokens, ref_lps = _hf_cuda(hf, ids, MAX_NEW)
        compared += assert_greedy_match(
            out.token_ids, out.logprobs, ref_tokens, ref_lps, atol=0.1, label=f"{variant} bf16"
        )
    assert compared >= MAX_NEW


def _hf_cuda(hf, ids: torch.Tensor, max_new: int):
    with torch.no_grad():
        out = hf.generate(
            ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=max_new,
            output_logits=True, return_dict_in_generate=True, pad_token_id=0, eos_token_id=None,
        )  # fmt: skip
    rows = []
    for logits in out.logits:
        values, idx = torch.log_softmax(logits[0].double(), dim=-1).topk(5)
        rows.append(dict(zip(idx.tolist(), values.tolist(), strict=True)))
    return out.sequences[0, ids.shape[1] :].tolist(), rows


def test_graph_replay_with_changing_adapters_is_bitwise_eager(tiny_llama_dir: Path, tmp_path: Path) -> None:
    base = load_model_config(tiny_llama_dir).base_shapes()
    adapters = [save_random_adapter(tmp_path / f"a{i}", base, rank=8, seed=i, std=0.2) for i in range(4)]

    def run(graphs: bool) -> dict:
        config = EngineConfig(num_kv_blocks=256, block_size=16, max_num_seqs=16, max_loras=4,
                              enable_cuda_graphs=graphs)  # fmt: skip
        engine = LLMEngine(tiny_llama_dir, device="cuda", dtype="bfloat16", config=config)
        assert (engine.graphs is not None) == graphs
        cache = engine.lora.cache
        for path in adapters:  # loaded up front: both runs schedule the same steps
            cache.request_load(engine.lora.local_ref(path))
        for pending in list(cache.pending.values()):
            pending.future.result(timeout=60)
        cache.poll()
        prompts = random_prompts(12, 500, 3, 30, seed=7)
        finals = {}
        for i, prompt in enumerate(prompts):
            ref = None if i % 5 == 4 else engine.lora.local_ref(adapters[i % 4])
            params = SamplingParams(max_tokens=4 + 3 * (i % 4), ignore_eos=True, logprobs=3)
            engine.add_request(f"r{i}", prompt, params, adapter=ref)
            for _ in range(3):  # decode-only steps of changing size and adapter set between arrivals
                finals.update({o.request_id: o for o in engine.step() if o.finished})
        while engine.has_unfinished:
            finals.update({o.request_id: o for o in engine.step() if o.finished})
        return {rid: (o.token_ids, o.logprobs) for rid, o in finals.items()}

    assert run(graphs=True) == run(graphs=False)
