"""Which `adapter_config.json` fields PEFT 0.21 (`peft/tuners/lora/config.py`) applies, which cannot change
inference math and are ignored, and which are refused when set (adapters/README.md lists them); plus the
type checks and the pattern budget the rank and target readers share. Fail closed: an unknown LoRA
variant field that is set is an `AdapterFormatError` naming it."""

from __future__ import annotations

import logging
from typing import Any

from adapters.safe_regex import MAX_PATTERN_KEYS, MAX_TOTAL_PATTERN_CHARS
from adapters.types import AdapterFormatError

logger = logging.getLogger(__name__)

# Gemma3ForConditionalGeneration ("gemma3") nests its text model (module keys
# model.language_model.layers...), which adapter keys do not follow yet: refused by its model_type.
SUPPORTED_MODEL_TYPES: tuple[str, ...] = (
    "llama", "mistral", "qwen2", "qwen3", "gemma2", "gemma3_text", "phi3",
    "qwen3_moe", "qwen2_moe", "mixtral",
)  # fmt: skip

# Fields whose non-default value changes what the adapter computes in a way the engine cannot reproduce.
REFUSED_WHEN_SET: dict[str, str] = {
    "use_qalora": "QA-LoRA pools the input before lora_A",
    "lora_bias": "a trained bias on lora_B",
    "trainable_token_indices": "trained embedding rows",
    "layer_replication": "a different (replicated) layer stack",
    "megatron_config": "Megatron parallel-linear layers",
    "alora_invocation_tokens": "activated LoRA applies only after the invocation tokens",
    "use_bdlora": "block-diagonal LoRA factors",
    "kasa_config": "KaSA inserts a learned diagonal and truncates the base weight",
    "monteclora_config": "Monte Carlo sampling around the LoRA factors",
    "arrow_config": "Arrow routing between several adapters",
}
# init_lora_weights values whose initialisation rewrites the base weight (PiSSA/OLoRA/CorDA/LoftQ/LoRA-GA):
# PEFT re-runs it on load, so the adapter only matches PEFT on a modified base model.
_BASE_REWRITING_INITS: tuple[str, ...] = ("pissa", "olora", "corda", "loftq", "lora_ga")
_HARMLESS_INITS: tuple[str, ...] = ("gaussian", "eva", "orthogonal", "mica")
# Fields read here or in format.py, and fields ignored because they cannot change inference math.
APPLIED_FIELDS: frozenset[str] = frozenset(
    {"peft_type", "task_type", "r", "lora_alpha", "use_rslora", "target_modules", "exclude_modules"}
    | {"layers_to_transform", "layers_pattern", "rank_pattern", "alpha_pattern", "bias", "init_lora_weights"}
    | {"use_dora", "modules_to_save", "target_parameters"}
)
IGNORED_FIELDS: frozenset[str] = frozenset(
    {"lora_dropout", "fan_in_fan_out", "inference_mode", "base_model_name_or_path", "revision"}
    | {"peft_version", "auto_mapping", "loftq_config", "eva_config", "corda_config", "lora_ga_config"}
    | {"velora_config", "qalora_group_size", "megatron_core", "ensure_weight_tying", "runtime_config"}
)


def check_pattern_budget(cfg: dict[str, Any]) -> None:
    """Bound the number and total length of a config's patterns before any is compiled."""
    total = 0
    for name in ("target_modules", "exclude_modules", "layers_pattern"):
        value = cfg.get(name)
        if isinstance(value, str):
            total += len(value)
        elif isinstance(value, list):  # names (matched exactly or as a suffix), or layers patterns
            if len(value) > MAX_PATTERN_KEYS:
                raise AdapterFormatError(f"{name} has {len(value)} entries, more than {MAX_PATTERN_KEYS}")
            if name == "layers_pattern":
                total += sum(len(v) for v in value if isinstance(v, str))
    for name in ("rank_pattern", "alpha_pattern"):
        value = cfg.get(name)
        if isinstance(value, dict):
            if len(value) > MAX_PATTERN_KEYS:
                raise AdapterFormatError(f"{name} has {len(value)} entries, more than {MAX_PATTERN_KEYS}")
            total += sum(len(k) for k in value)
    if total > MAX_TOTAL_PATTERN_CHARS:
        raise AdapterFormatError(
            f"adapter_config.json: its regular expressions have {total} characters together, more than "
            f"{MAX_TOTAL_PATTERN_CHARS}"
        )


def is_default(value: Any) -> bool:
    return value is None or value is False or value == [] or value == {} or value == ""


def check_type(cfg: dict[str, Any], name: str, types: type | tuple[type, ...], default: Any) -> Any:
    value = cfg.get(name, default)
    if isinstance(value, bool) and bool not in (types if isinstance(types, tuple) else (types,)):
        raise AdapterFormatError(f"adapter_config.json: {name}={value!r} must be {types}, not a bool")
    if not isinstance(value, types):
        raise AdapterFormatError(f"adapter_config.json: {name}={value!r} has type {type(value).__name__}")
    return value


def check_fields(cfg: dict[str, Any]) -> None:
    """Refuse every field whose value changes inference math in a way the engine cannot apply."""
    if cfg.get("peft_type") != "LORA":
        raise AdapterFormatError(f"adapter_config.json: peft_type={cfg.get('peft_type')!r}, expected 'LORA'")
    if cfg.get("task_type") not in (None, "CAUSAL_LM"):
        raise AdapterFormatError(f"task_type={cfg['task_type']!r} is not supported; expected 'CAUSAL_LM'")
    for name, why in REFUSED_WHEN_SET.items():
        if not is_default(cfg.get(name)):
            raise AdapterFormatError(f"{name}={cfg[name]!r} is not supported ({why})")
    if cfg.get("bias") not in (None, "none"):
        raise AdapterFormatError(f"bias={cfg['bias']!r} is not supported (trained biases); expected 'none'")
    init = cfg.get("init_lora_weights", True)
    if not isinstance(init, bool):
        name = str(init).lower()
        if name.startswith(_BASE_REWRITING_INITS):
            raise AdapterFormatError(
                f"init_lora_weights={init!r} rewrites the base weights, so the adapter needs a modified base "
                "model; re-save it with path_initial_model_for_weight_conversion"
            )
        if name not in _HARMLESS_INITS:
            raise AdapterFormatError(
                f"init_lora_weights={init!r} is unknown; expected a bool or {_HARMLESS_INITS}"
            )
    for name, value in cfg.items():
        if name in APPLIED_FIELDS or name in IGNORED_FIELDS or name in REFUSED_WHEN_SET:
            continue
        # PEFT names LoRA variants `use_*` (flags) or `*_config` (sub-configs): an unknown one that is set
        # probably changes the math, so refuse it; other unknown keys are metadata.
        if (name.startswith("use_") or name.endswith("_config")) and not is_default(value):
            raise AdapterFormatError(f"unknown LoRA variant field {name}={value!r} is not supported")
        logger.debug("ignoring adapter_config.json metadata field %s", name)
