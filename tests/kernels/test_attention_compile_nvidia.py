"""The paged attention kernels compile for an NVIDIA GPU (sm_90: H100/H200), checked on a CPU-only machine.

The test runs this file as a script without TRITON_INTERPRET (the interpreter replaces @triton.jit
functions at import), which compiles each variant through Triton's ahead-of-time path down to a cubin:
    python tests/kernels/test_attention_compile_nvidia.py [arch]
It catches what the CPU interpreter cannot: tl.dot shape rules (every dot dim >= 16), types that differ
across branches or loop iterations, and anything else the real compiler rejects.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

# (kernel, dtype, group, head_dim, block_size, block table dtype, num_splits / block_m, window, softcap)
VARIANTS = (
    ("decode", "bf16", 4, 128, 16, "i32", 1, False, False),  # Llama-3-8B
    ("decode", "fp16", 1, 64, 32, "i64", 4, True, False),  # MHA, split-KV, sliding window
    ("decode", "fp32", 7, 128, 16, "i64", 2, False, False),  # Qwen2-7B group of 7, IEEE fp32 dots
    ("decode", "bf16", 2, 256, 16, "i32", 2, True, True),  # Gemma 2: head_dim 256, soft-cap, window
    ("merge", "bf16", 4, 128, 16, "i32", 8, False, False),
    ("prefill", "bf16", 4, 128, 16, "i32", 128, False, False),
    ("prefill", "fp16", 7, 96, 32, "i64", 64, True, False),  # head_dim padded to 128
    ("prefill", "bf16", 2, 256, 16, "i32", 128, True, True),  # Gemma 2
)


def compile_variant(kernel, dtype, group, head_dim, block_size, bt, tile, window, softcap, arch: int) -> str:
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from kernels.attention import triton_ops

    precision = "ieee" if dtype == "fp32" else "tf32"
    block_d = max(16, triton.next_power_of_2(head_dim))
    unit = {"stride_qd": 1, "stride_cd": 1, "stride_kd": 1, "stride_od": 1}  # the JIT specializes these
    if kernel == "decode":
        fn = triton_ops._decode_kernel
        ptrs = {p: f"*{dtype}" for p in ("q_ptr", "k_cache_ptr", "v_cache_ptr", "out_ptr")}
        ptrs |= {"bt_ptr": f"*{bt}", "seq_lens_ptr": "*i32", "rows_ptr": "*i64"}
        ptrs |= {"part_o_ptr": "*fp32", "part_lse_ptr": "*fp32", "qk_scale": "fp32", "cap_log2": "fp32"}
        consts = dict(
            GROUP=group, HEAD_DIM=head_dim, BLOCK_SIZE=block_size,
            BLOCK_G=max(16, triton.next_power_of_2(group)), BLOCK_N=64, BLOCK_D=block_d, NUM_SPLITS=tile,
            HAS_ROWS=True, HAS_WINDOW=window, HAS_SOFTCAP=softcap,
        )  # fmt: skip
    elif kernel == "merge":
        fn = triton_ops._merge_splits_kernel
        ptrs = {"part_o_ptr": "*fp32", "part_lse_ptr": "*fp32", "rows_ptr": "*i32", "out_ptr": f"*{dtype}"}
        consts = dict(HEAD_DIM=head_dim, BLOCK_D=block_d, NUM_SPLITS=tile, BLOCK_S=tile, HAS_ROWS=True)
    else:
        fn = triton_ops._prefill_kernel
        ptrs = {p: f"*{dtype}" for p in ("q_ptr", "k_ptr", "v_ptr", "k_cache_ptr", "v_cache_ptr", "out_ptr")}
        ptrs |= {"bt_ptr": f"*{bt}", "qk_scale": "fp32", "cap_log2": "fp32"}
        ptrs |= {p: "*i32" for p in ("query_starts_ptr", "query_lens_ptr", "seq_lens_ptr")}
        consts = dict(
            GROUP=group, HEAD_DIM=head_dim, BLOCK_SIZE=block_size, BLOCK_M=tile, BLOCK_Q=tile // group,
            BLOCK_N=64, BLOCK_D=block_d, HAS_WINDOW=window, HAS_SOFTCAP=softcap,
        )  # fmt: skip
    if kernel != "merge":
        consts |= {"PRECISION": precision, "UPCAST": False}
    consts |= {name: value for name, value in unit.items() if name in fn.arg_names}
    signature = {name: "constexpr" if name in consts else ptrs.get(name, "i32") for name in fn.arg_names}
    options = {"num_warps": 8 if kernel == "prefill" and tile >= 128 else 4}  # as the launcher picks
    source = ASTSource(fn, signature, constexprs=consts)
    compiled = triton.compile(source, target=GPUTarget("cuda", arch, 32), options=options)
    assert compiled.asm.get("cubin"), "no cubin"
    # a launch asking for more shared memory than an H100/H200 block may have fails "out of resources"
    assert compiled.metadata.shared <= 227 * 1024, f"{compiled.metadata.shared} bytes of shared memory"
    shape = f"G={group} D={head_dim} bs={block_size} tile={tile} window={window} softcap={softcap}"
    return f"{kernel} {dtype} {shape} sm_{arch}: ok"


@pytest.mark.slow
def test_attention_kernels_compile_for_nvidia(tmp_path: Path) -> None:
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
