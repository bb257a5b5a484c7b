"""Options shared by several `loraserve` commands (api/cli/main.py, api/cli/serve.py), and the help suffix
that shows a `Settings` field's default.

Separate so that `serve` (api/cli/serve.py) and the other commands (api/cli/main.py) declare the same
`--model`, `--data-dir`, `--db` and `--registry` without importing each other.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Annotated

import typer

from api.settings import Settings


def settings_default(name: str, when_none: str = "set by the server") -> str:
    """The help suffix "[default: X]" of the Settings field `name` (options default to None: settings)."""
    value = Settings.model_fields[name].default
    return f"[default: {when_none if value is None else value}]"


ModelOpt = Annotated[
    Path | None,
    typer.Option(
        help="HF checkpoint directory, .gguf file (converted once, cached by hash), 'smollm2' or "
        "'random-demo' (tests) [default: SmolLM2-135M-Instruct, fetched and converted once]"
    ),
]
DataDirOpt = Annotated[Path | None, typer.Option(help="data directory [default: ./loraserve-data]")]
DbOpt = Annotated[str | None, typer.Option(help="SQLAlchemy URL [default: SQLite in the data dir]")]
RegistryOpt = Annotated[
    str | None, typer.Option(help="file:///dir or s3://bucket/prefix [default: data dir]")
]


def setup_logging(level: str) -> None:
    logging.basicConfig(level=level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")


# What one request may ask of the shared engine (api/inference/limits.py); more is a 400 naming the limit.
MaxChoicesOpt = Annotated[
    int | None,
    typer.Option(help=f"choices (n x prompts) per request {settings_default('max_choices_per_request')}"),
]
MaxLogprobEntriesOpt = Annotated[
    int | None,
    typer.Option(
        help="logprob entries per response: choices x max_tokens x (top logprobs + 1) "
        + settings_default("max_logprob_entries_per_response")
    ),
]
MaxStopStringsOpt = Annotated[
    int | None, typer.Option(help=f"stop strings per request {settings_default('max_stop_strings')}")
]
MaxStopStringCharsOpt = Annotated[
    int | None,
    typer.Option(help=f"characters per stop string {settings_default('max_stop_string_chars')}"),
]
MaxStopTokenIdsOpt = Annotated[
    int | None, typer.Option(help=f"stop token ids per request {settings_default('max_stop_token_ids')}")
]
