"""Bad input to add_lora / sgmv_shrink / sgmv_expand: one clear ValueError naming what was wrong."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch

from kernels.sgmv import add_lora, build_meta, sgmv_expand
from tests.kernels.reference import Case, small_case


def call(case: Case, **overrides: object) -> None:
    """add_lora on a valid small case (T=9, H_in=32, slices 16+8, N=4, R_max=8), some argument replaced."""
    args: dict = dict(
        y=case.y, x=case.x, lora_a=case.lora_a, lora_b=case.lora_b, token_slots=case.token_slots,
        scales=case.scales, ranks=case.ranks, backend="torch",
    )  # fmt: skip
    args.update(overrides)
    add_lora(**args)


BAD_INPUTS: dict[str, tuple[Callable[[Case], dict], str]] = {
    "slot >= N": (
        lambda c: {"token_slots": torch.tensor([0, 1, 2, 3, 4, -1, 0, 0, 0])},
        r"token_slots\[4\] = 4",
    ),
    "slot < -1": (
        lambda c: {"token_slots": torch.tensor([0, -3, 0, 0, 0, 0, 0, 0, 0])},
        r"token_slots\[1\] = -3",
    ),
    "rank > R_max": (
        lambda c: {"ranks": torch.tensor([8, 9, 1, 1])},
        r"ranks\[1\] = 9: expected 0 <= rank <= R_max=8",
    ),
    "negative rank": (
        lambda c: {"ranks": torch.tensor([[1, 1, 1, 1], [1, 1, -1, 1]])},
        r"ranks\[1, 2\] = -1",
    ),
    "float ranks": (lambda c: {"ranks": torch.ones(4)}, "ranks has dtype torch.float32"),
    "scales shape": (
        lambda c: {"scales": torch.ones(5)},
        r"scales has shape \(5,\), expected \[4\] or \[2, 4\]",
    ),
    "x width": (lambda c: {"x": torch.zeros(9, 31)}, r"x has shape \(9, 31\), expected \[T, 32\]"),
    "y width": (lambda c: {"y": torch.zeros(9, 25)}, r"y has shape \(9, 25\), expected \[9, 24\]"),
    "y rows": (lambda c: {"y": torch.zeros(8, 24)}, r"y has shape \(8, 24\), expected \[9, 24\]"),
    "x 3-D": (lambda c: {"x": torch.zeros(9, 32, 1)}, "x must be a 2-D tensor"),
    "x dtype": (
        lambda c: {"x": c.x.half()},
        "lora_a.0. has dtype torch.float32, expected torch.float16 like x",
    ),
    "y dtype": (lambda c: {"y": c.y.double()}, "y has dtype torch.float64, expected torch.float32 like x"),
    "int x": (lambda c: {"x": c.x.int(), "lora_a": [w.int() for w in c.lora_a]}, "x has dtype torch.int32"),
    "device": (
        lambda c: {"lora_b": [c.lora_b[0].to("meta"), c.lora_b[1]]},
        "lora_b.0. is on meta, expected cpu",
    ),
    "lora_a tensor": (lambda c: {"lora_a": c.lora_a[0]}, "lora_a must be a non-empty list"),
    "lora_a empty": (lambda c: {"lora_a": []}, "lora_a must be a non-empty list"),
    "lora_a 2-D": (lambda c: {"lora_a": [c.lora_a[0][0], c.lora_a[1]]}, r"lora_a\[0\] must be a 3-D tensor"),
    "lora_a mixed": (lambda c: {"lora_a": [c.lora_a[0], c.lora_a[1][:, :4]]}, r"lora_a\[1\] has shape"),
    "lora_b count": (lambda c: {"lora_b": c.lora_b[:1]}, "lora_b has 1 slices, expected 2"),
    "lora_b slots": (
        lambda c: {"lora_b": [c.lora_b[0][:3], c.lora_b[1]]},
        r"lora_b\[0\] has shape \(3, 16, 8\)",
    ),
    "lora_b rank": (lambda c: {"lora_b": [c.lora_b[0], c.lora_b[1][..., :4]]}, r"expected \[4, H_out, 8\]"),
    "token_slots rows": (
        lambda c: {"token_slots": torch.zeros(10, dtype=torch.int64)},
        r"token_slots has shape \(10,\), expected \[9\]",
    ),
    "backend": (lambda c: {"backend": "cuda"}, "backend='cuda', expected one of"),
    "meta tokens": (
        lambda c: {"meta": build_meta(torch.zeros(8, dtype=torch.int64), 4)},
        "built for 8 tokens",
    ),
    "meta slots": (lambda c: {"meta": build_meta(torch.zeros(9, dtype=torch.int64), 5)}, "built for 5 slots"),
    "meta type": (lambda c: {"meta": object()}, "meta must be an SgmvMeta"),
}


@pytest.mark.parametrize("name", list(BAD_INPUTS))
def test_bad_input_is_a_value_error_naming_it(name: str) -> None:
    make_overrides, message = BAD_INPUTS[name]
    case = small_case()
    before = case.buf.clone()
    with pytest.raises(ValueError, match=message):
        call(case, **make_overrides(case))
    assert torch.equal(case.buf, before)  # nothing written before the check fails


def test_expand_checks_its_intermediate() -> None:
    case = small_case()
    v = torch.zeros(2, 9, 8)
    with pytest.raises(ValueError, match=r"v has shape \(2, 9, 7\), expected \[S, T, R_max\] = \[2, 9, 8\]"):
        sgmv_expand(case.y, v[..., :7], case.lora_b, case.token_slots, backend="torch")
    with pytest.raises(ValueError, match="v is torch.float16"):
        sgmv_expand(case.y, v.half(), case.lora_b, case.token_slots, backend="torch")
