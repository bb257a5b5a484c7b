"""SGMV multi-LoRA kernels: apply a different adapter to every row of a batch (see README.md)."""

from kernels.sgmv.api import add_lora, sgmv_expand, sgmv_shrink
from kernels.sgmv.meta import SgmvMeta, build_meta

__all__ = ["SgmvMeta", "add_lora", "build_meta", "sgmv_expand", "sgmv_shrink"]
