"""Read a PEFT LoRA `adapter_config.json` exactly as PEFT (0.21, `peft/tuners/lora/config.py`) reads it.

Which modules an adapter targets follows `peft.tuners.tuners_utils.check_target_module_exists` (regex
full-match for a string, exact-or-`.suffix` match for a list, `exclude_modules` first, then
`layers_to_transform` / `layers_pattern`); per-module rank and alpha follow
`peft.utils.other.get_pattern_key` (`re.match(rf"(.*\\.)?({key})$", module_key)`, first key wins); the
scale is `alpha / r`, or `alpha / sqrt(r)` with rsLoRA (Kalajdzievski 2023, arXiv:2312.03732).

Every tenant-supplied pattern is compiled by adapters/safe_regex.py and matched by RE2 in linear time
(PEFT's `re` backtracks: `(.|.){0,24}Z` took minutes); patterns RE2 cannot express, and configs whose
patterns are too many or too long, are refused naming the field.

Every field is applied, ignored because it cannot change inference math, or refused when it is not at its
default (see adapters/README.md for the full list). Fail closed: anything these modules cannot prove PEFT
would apply the same way is an `AdapterFormatError` naming the field.

The reader is three modules, re-exported here: peft_fields.py (applied / ignored / refused fields),
peft_rank.py (per-module rank and scale), peft_targets.py (which modules are targeted).
"""

from __future__ import annotations

from adapters.peft_fields import (
    APPLIED_FIELDS,
    IGNORED_FIELDS,
    REFUSED_WHEN_SET,
    SUPPORTED_MODEL_TYPES,
    check_fields,
)
from adapters.peft_rank import LoraSpec, parse_spec
from adapters.peft_targets import DEFAULT_TARGET_MODULES, module_keys, projection_key, resolve_targets

__all__ = [
    "APPLIED_FIELDS",
    "DEFAULT_TARGET_MODULES",
    "IGNORED_FIELDS",
    "REFUSED_WHEN_SET",
    "SUPPORTED_MODEL_TYPES",
    "LoraSpec",
    "check_fields",
    "module_keys",
    "parse_spec",
    "projection_key",
    "resolve_targets",
]
