"""Compile the SGMV kernels for an NVIDIA target without a GPU (Triton's ahead-of-time path).

Run as a script with TRITON_INTERPRET unset (the interpreter replaces @triton.jit functions):
    python tests/kernels/aot_compile.py [arch]
Prints one line per variant and exits non-zero on the first compile error. Catches what the CPU
interpreter cannot: tl.dot shape rules (every dot dim >= 16), type mismatches across branches, and
anything else the real compiler rejects.
"""

from __future__ import annotations

import sys

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from kernels.sgmv import triton_ops

META_PTRS = {"rows_ptr": "*i64", "seg_starts_ptr": "*i32", "seg_lens_ptr": "*i32", "seg_slots_ptr": "*i32"}


def signature(
    fn: triton.JITFunction, pointers: dict[str, str], constants: dict[str, object]
) -> dict[str, str]:
    return {name: "constexpr" if name in constants else pointers.get(name, "i32") for name in fn.arg_names}


# (kernel, dtype, split_k, DoRA output vectors): each dtype path, the atomic split-K store, IEEE fp32
# dots, the expand with and without DoRA's out_scale / out_shift
VARIANTS = (
    ("shrink", "bf16", 4, False), ("shrink", "fp32", 1, False), ("expand", "fp16", 1, False),
    ("expand", "fp32", 1, False), ("expand", "bf16", 1, True),
)  # fmt: skip


def compile_variant(kernel: str, dtype: str, split_k: int, dora: bool, arch: int) -> None:
    precision = "ieee" if dtype == "fp32" else "tf32"
    if kernel == "shrink":
        fn = triton_ops._shrink_kernel
        ptrs = {p: f"*{dtype}" for p in ("x_ptr", "a0_ptr", "a1_ptr", "a2_ptr")}
        ptrs |= META_PTRS | {"v_ptr": "*fp32", "scales_ptr": "*fp32", "ranks_ptr": "*i32"}
        consts = dict(BLOCK_M=16, BLOCK_N=16, BLOCK_K=128, SPLIT_K=split_k, stride_xk=1, stride_ak=1)
    else:
        fn = triton_ops._expand_kernel
        ptrs = {p: f"*{dtype}" for p in ("y_ptr", "b0_ptr", "b1_ptr", "b2_ptr")}
        ptrs |= META_PTRS | {"v_ptr": "*fp32", "ranks_ptr": "*i32"}
        ptrs |= {"oscale_ptr": "*fp32", "oshift_ptr": "*fp32"}
        consts = dict(BLOCK_M=16, BLOCK_N=128, BLOCK_K=16, stride_yh=1, stride_br=1)
        consts |= {"HAS_SCALE": dora, "HAS_SHIFT": dora}
    consts |= {"PRECISION": precision, "UPCAST": False}
    source = ASTSource(fn, signature(fn, ptrs, consts), constexprs=consts)
    triton.compile(source, target=GPUTarget("cuda", arch, 32))
    print(f"{kernel} {dtype} split_k={split_k} dora={dora} sm_{arch}: ok")


if __name__ == "__main__":
    for variant in VARIANTS:
        compile_variant(*variant, arch=int(sys.argv[1]) if len(sys.argv) > 1 else 90)
