"""The checkpoint's tokenizer and chat template, as Hugging Face `transformers` saves them.

Files: `tokenizer.json` (the `tokenizers` library's format) + `tokenizer_config.json`; the chat
template (a Jinja string) either under `chat_template` in tokenizer_config.json or, as recent
`transformers` writes it, in `chat_template.jinja`. Chats are rendered to text and then encoded without
adding special tokens, since the template itself writes the BOS token (as vLLM and `transformers` do).
A caller may hand the template extra variables (vLLM's `chat_template_kwargs`, e.g. Qwen3's
`enable_thinking`); they may not replace what the render itself passes or defines.
"""

from __future__ import annotations

import inspect
import logging
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from jinja2 import TemplateError
from jinja2.defaults import DEFAULT_NAMESPACE
from transformers import AutoTokenizer, PreTrainedTokenizerBase, PreTrainedTokenizerFast

logger = logging.getLogger(__name__)

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")
CHAT_TEMPLATE_FILE = "chat_template.jinja"
# What a caller's template variable may not be named: apply_chat_template's own arguments, the
# `messages` it renders, and the globals transformers and Jinja define for every template.
RESERVED_TEMPLATE_NAMES: frozenset[str] = frozenset(
    {*inspect.signature(PreTrainedTokenizerBase.apply_chat_template).parameters, *DEFAULT_NAMESPACE}
    - {"self", "kwargs"}
    | {"messages", "raise_exception", "strftime_now"}
)


def load_tokenizer(model_dir: Path) -> PreTrainedTokenizerFast:
    """The fast tokenizer of `model_dir`, with its chat template when the checkpoint has one."""
    model_dir = Path(model_dir)
    if not (model_dir / "tokenizer.json").is_file():
        present = sorted(p.name for p in model_dir.iterdir()) if model_dir.is_dir() else "directory missing"
        raise FileNotFoundError(
            f"no tokenizer.json in {model_dir} (found: {present}); expected the fast-tokenizer files "
            f"{TOKENIZER_FILES} that transformers' save_pretrained writes"
        )
    try:
        tokenizer = AutoTokenizer.from_pretrained(model_dir, local_files_only=True)
    except (OSError, ValueError) as exc:
        raise ValueError(f"cannot load the tokenizer in {model_dir}: {exc}") from exc
    if not isinstance(tokenizer, PreTrainedTokenizerFast):
        raise ValueError(
            f"tokenizer in {model_dir} loaded as {type(tokenizer).__name__}; expected a fast tokenizer "
            f"(tokenizer.json)"
        )
    if tokenizer.chat_template is None:
        logger.info("checkpoint %s has no chat template; chat requests will be refused", model_dir)
    return tokenizer


def has_chat_template(tokenizer: PreTrainedTokenizerFast) -> bool:
    return tokenizer.chat_template is not None


def check_template_variables(variables: Mapping[str, Any]) -> None:
    """ValueError naming the first variable that is not a plain name or would replace a reserved one."""
    for name in variables:
        if not name.isidentifier() or name.startswith("_"):
            raise ValueError(
                f"template variable {name!r} is not a name (letters, digits and '_', not '_' first)"
            )
        if name in RESERVED_TEMPLATE_NAMES:
            raise ValueError(
                f"template variable {name!r} would replace what the render sets; reserved: "
                f"{sorted(RESERVED_TEMPLATE_NAMES)}"
            )


def render_chat(
    tokenizer: PreTrainedTokenizerFast,
    messages: Sequence[Mapping[str, Any]],
    *,
    add_generation_prompt: bool = True,
    variables: Mapping[str, Any] | None = None,
    **template_kwargs: Any,
) -> str:
    """The prompt text the chat template makes of `messages` ([{"role": ..., "content": ...}, ...]);
    `variables` are the caller's extra template variables (checked by `check_template_variables`)."""
    if variables:
        check_template_variables(variables)
        template_kwargs = {**variables, **template_kwargs}
    if tokenizer.chat_template is None:
        raise ValueError(
            f"this model's tokenizer ({tokenizer.name_or_path}) has no chat template (neither "
            f"'chat_template' in tokenizer_config.json nor {CHAT_TEMPLATE_FILE}); use a completion prompt"
        )
    try:
        text = tokenizer.apply_chat_template(
            [dict(m) for m in messages],
            tokenize=False,
            add_generation_prompt=add_generation_prompt,
            **template_kwargs,
        )
    except (TemplateError, TypeError) as exc:  # TypeError: e.g. a variable of a type the template cannot add
        raise ValueError(f"the chat template rejected these messages: {exc}") from exc
    assert isinstance(text, str)
    return text


def apply_chat_template(
    tokenizer: PreTrainedTokenizerFast,
    messages: Sequence[Mapping[str, Any]],
    *,
    add_generation_prompt: bool = True,
    **template_kwargs: Any,
) -> list[int]:
    """Token ids of the rendered chat; the template already writes BOS, so none is added."""
    text = render_chat(tokenizer, messages, add_generation_prompt=add_generation_prompt, **template_kwargs)
    return list(tokenizer.encode(text, add_special_tokens=False))
