"""The grouped MoE GEMM compiles for an NVIDIA GPU (sm_90: H100/H200), checked on a CPU-only machine.

The test runs this file as a script without TRITON_INTERPRET (the interpreter replaces @triton.jit
functions at import), compiling each variant through Triton's ahead-of-time path down to a cubin:
    python tests/kernels/test_moe_compile_nvidia.py [arch]
It catches what the CPU interpreter cannot: tl.dot shape rules, types across branches, shared memory.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

# (dtype, BLOCK_M, BLOCK_N, BLOCK_K): the launcher's CUDA blocks (kernels/moe/grouped_triton._blocks) at
# Qwen3-30B-A3B shapes (gate_up N=1536, K=2048; down N=2048, K=768) and the smallest tiles
VARIANTS = (
    ("bf16", 64, 128, 64),
    ("fp16", 64, 128, 64),
    ("fp32", 64, 128, 64),  # IEEE fp32 dots
    ("bf16", 64, 16, 16),
    ("fp32", 16, 16, 16),
)


def compile_variant(dtype: str, block_m: int, block_n: int, block_k: int, arch: int) -> str:
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from kernels.moe import grouped_triton

    fn = grouped_triton._grouped_kernel
    ptrs = {"x_ptr": f"*{dtype}", "w_ptr": f"*{dtype}", "y_ptr": f"*{dtype}"}
    ptrs |= {"offsets_ptr": "*i64", "tile_expert_ptr": "*i32", "tile_row_ptr": "*i64"}
    ptrs |= {"stride_we": "i64"}  # E x N x K exceeds 2^31 elements on large MoE models
    consts = dict(BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, UPCAST=False)
    consts |= {
        "PRECISION": "ieee" if dtype == "fp32" else "tf32",
        "stride_xk": 1,
        "stride_wk": 1,
        "stride_yn": 1,
    }
    signature = {name: "constexpr" if name in consts else ptrs.get(name, "i32") for name in fn.arg_names}
    source = ASTSource(fn, signature, constexprs=consts)
    compiled = triton.compile(source, target=GPUTarget("cuda", arch, 32), options={"num_warps": 4})
    assert compiled.asm.get("cubin"), "no cubin"
    assert compiled.metadata.shared <= 227 * 1024, f"{compiled.metadata.shared} bytes of shared memory"
    return f"grouped {dtype} blocks=({block_m}, {block_n}, {block_k}) sm_{arch}: ok"


@pytest.mark.slow
def test_grouped_gemm_compiles_for_nvidia(tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env |= {"TRITON_CACHE_DIR": str(tmp_path), "PYTHONPATH": str(ROOT), "TRITON_DEFAULT_FP_FUSION": "1"}
    done = subprocess.run(
        [sys.executable, __file__, "90"], env=env, capture_output=True, text=True, timeout=600
    )
    assert done.returncode == 0, done.stderr[-4000:]
    assert done.stdout.count(": ok") == len(VARIANTS), done.stdout


if __name__ == "__main__":
    sys.path.insert(0, str(ROOT))
    for variant in VARIANTS:
        print(compile_variant(*variant, arch=int(sys.argv[1]) if len(sys.argv) > 1 else 90), flush=True)
