"""`vllm serve`'s command line, accepted by `loraserve serve` where it maps (rewritten before Typer parses:
click has no `nargs='+'` options).

    loraserve serve MODEL --enable-lora --lora-modules a=DIR b=DIR --api-key k --tensor-parallel-size 1

- positional MODEL (a word that is no option's value, as `vllm serve MODEL`) -> `--model MODEL`;
- `--enable-lora` -> dropped (adapters are always on);
- `--lora-modules a=DIR '{"name": "b", "path": "DIR"}' ...` -> one `--lora-module` each, registered at
  start for the `--tenant` (default: the demo tenant);
- `--tensor-parallel-size` / `-tp` 1 -> dropped; more -> refused by name (`VllmFlagError`);
- `--served-model-name`, `--max-model-len`, `--dtype`, `--max-loras`, `--max-lora-rank`,
  `--max-cpu-loras`, `--api-key` are `serve`'s own options (api/cli/serve.py); `--version` is main's.
"""

from __future__ import annotations

import json

_TP_FLAGS = ("--tensor-parallel-size", "-tp")
# Options of `serve` that take no value: a word after one of them is the positional MODEL.
_SWITCHES = frozenset({"--enable-lora", "--deterministic", "--fleet", "--ray"})


class VllmFlagError(ValueError):
    """A vLLM flag we cannot honour: the message names it."""


def rewrite_vllm_argv(argv: list[str]) -> list[str]:
    """`serve`'s arguments in vLLM's form -> ours; other commands are returned as they are."""
    if not argv or argv[0] != "serve":
        return argv
    out = ["serve"]
    rest = argv[1:]
    i = 0
    while i < len(rest):
        arg = rest[i]
        flag, _, inline = arg.partition("=")
        before = rest[i - 1] if i else ""
        is_value = before.startswith("-") and "=" not in before and before not in _SWITCHES
        if not arg.startswith("-") and not is_value:
            out += ["--model", arg]
            i += 1
        elif arg == "--enable-lora":
            i += 1
        elif flag in _TP_FLAGS:
            value, i = (inline, i + 1) if inline else (rest[i + 1] if i + 1 < len(rest) else "", i + 2)
            _check_tensor_parallel(flag, value)
        elif arg == "--lora-modules":
            i += 1
            while i < len(rest) and not rest[i].startswith("-"):
                out += ["--lora-module", lora_module_spec(rest[i])]
                i += 1
        else:
            out.append(arg)
            i += 1
    return out


def lora_module_spec(value: str) -> str:
    """vLLM's `name=path` or JSON `{"name": ..., "path": ...}` -> `name=path`."""
    if value.startswith("{"):
        try:
            spec = json.loads(value)
            name, path = spec["name"], spec["path"]
        except (ValueError, KeyError, TypeError):
            raise VllmFlagError(
                f"--lora-modules {value!r}: expected name=path or JSON with 'name' and 'path'"
            ) from None
        return f"{name}={path}"
    if "=" not in value:
        raise VllmFlagError(f"--lora-modules {value!r}: expected name=path")
    return value


def _check_tensor_parallel(flag: str, value: str) -> None:
    if value == "1":
        return
    if not value.isdigit():
        raise VllmFlagError(f"{flag} {value!r}: expected a number of devices")
    raise VllmFlagError(
        f"{flag} {value}: tensor parallelism is not served; loraserve runs the model on one device per "
        f"replica (use --replicas N for more replicas)"
    )
