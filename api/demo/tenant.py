"""The embedded demo: a `demo` tenant and its LoRA adapters, for the default model or the random one.

Created once in the data directory when `loraserve serve` runs without `--model` (the default model,
SmolLM2-135M-Instruct) or with `--model random-demo`, then reused: the demo tenant's key is kept in
`<data_dir>/demo-tenant.key` (0600) so the printed curl line works after restarts.

- Default model: the trained adapters shipped in `api/demo/adapters/` (one per trait of
  `api.demo.traits.TRAITS`: ALL CAPS, pirate, JSON; made by scripts/train_demo_adapters.py).
- `random-demo`: a random-weight Llama checkpoint in `<data_dir>/demo-model` and two adapters of
  random LoRA factors in PEFT's on-disk format (`adapters.testing.save_random_adapter`), for tests.
  The weights are random: outputs are gibberish.
"""

from __future__ import annotations

import json
import logging
import shutil
import tempfile
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from sqlalchemy.orm import Session, sessionmaker

from adapters.testing import save_random_adapter
from adapters.types import AdapterSummary, BaseModelShapes
from api.demo.traits import TRAITS
from api.tenancy.keyfiles import DEMO_KEY_FILE, read_secret, replace_secret
from base_engine.testing.checkpoint import save_random_checkpoint
from registry.adapters import list_adapters, register_adapter_version
from registry.errors import AuthError, NotFound
from registry.keys import authenticate, issue_key
from registry.store import ObjectStore
from registry.tenants import create_tenant, get_tenant_by_name

logger = logging.getLogger(__name__)

DEMO_TENANT = "demo"
# Random-demo adapters: name -> (rank, target modules)
DEMO_ADAPTERS: dict[str, tuple[int, tuple[str, ...]]] = {
    "demo-qv-r8": (8, ("q_proj", "v_proj")),
    "demo-all-r4": (4, ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")),
}
DEMO_CHECKPOINT = {
    "arch": "llama",
    "hidden_size": 256,
    "num_hidden_layers": 4,
    "num_attention_heads": 8,
    "num_key_value_heads": 4,
    "intermediate_size": 688,
    "vocab_size": 512,
    "max_position_embeddings": 4096,
}


# The trained adapters of the default model, one directory per trait (scripts/train_demo_adapters.py).
DEMO_ADAPTERS_DIR = Path(__file__).resolve().parent / "adapters"
# Each trained demo adapter's sampling defaults, applied where a request omits the field
# (api/inference/adapter_defaults.py): `shout` loops under greedy decoding without a penalty.
GENERATION_DEFAULTS_FILE = DEMO_ADAPTERS_DIR / "generation-defaults.json"


def demo_generation_defaults() -> dict[str, dict[str, float]]:
    """The shipped adapters' sampling defaults: adapter name -> {field: value}."""
    raw = json.loads(GENERATION_DEFAULTS_FILE.read_text())
    return {name: dict(fields) for name, fields in raw.items() if name in TRAITS}


@dataclass(frozen=True, slots=True)
class DemoInfo:
    """What `serve` prints for the demo tenant: its name, key and adapters."""

    tenant_name: str
    api_key: str
    adapter_names: tuple[str, ...]
    tenant_id: str = ""
    # adapter name -> the sampling defaults it is served with (GENERATION_DEFAULTS_FILE)
    generation_defaults: dict[str, dict[str, float]] = field(default_factory=dict)


def ensure_demo_checkpoint(model_dir: Path) -> Path:
    """The demo checkpoint in `model_dir`, written (to a temp dir, then renamed) on first use."""
    if (model_dir / "config.json").is_file():
        return model_dir
    model_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".demo-model-", dir=model_dir.parent))
    try:
        save_random_checkpoint(tmp, **DEMO_CHECKPOINT)  # type: ignore[arg-type]
        tmp.rename(model_dir)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    logger.info("created the random-weight demo checkpoint in %s", model_dir)
    return model_dir


def _demo_key(session: Session, key_file: Path) -> str:
    """The demo tenant's key from `key_file` if it still works, else a new one (tenant created once)."""
    saved = read_secret(key_file)
    if saved is not None:
        try:
            authenticate(session, api_key=saved)
            return saved
        except AuthError:
            logger.warning("the saved demo key no longer works; issuing a new one")
    try:
        tenant = get_tenant_by_name(session, name=DEMO_TENANT)
        _, api_key = issue_key(session, tenant_id=tenant.id, label="demo")
    except NotFound:
        _, api_key = create_tenant(session, name=DEMO_TENANT, key_label="demo")
    replace_secret(key_file, api_key)
    return api_key


def trained_adapter_dirs() -> dict[str, Path]:
    """The default model's demo adapters shipped with the code: name -> PEFT directory."""
    dirs = {name: DEMO_ADAPTERS_DIR / name for name in TRAITS}
    missing = [str(d) for d in dirs.values() if not (d / "adapter_model.safetensors").is_file()]
    if missing:
        raise FileNotFoundError(
            f"demo adapters missing: {missing}; rebuild them with scripts/train_demo_adapters.py"
        )
    return dirs


def ensure_demo_tenant(
    *,
    sessions: sessionmaker[Session],
    store: ObjectStore,
    data_dir: Path,
    shapes: BaseModelShapes,
    validate: Callable[[Path], AdapterSummary],
    base_model: str,
    random_adapters: bool = False,
) -> DemoInfo:
    """The demo tenant with its adapters: trained ones for the default model, random ones for the
    random demo (`random_adapters`). Adapters it already has are left as they are."""
    names = tuple(DEMO_ADAPTERS) if random_adapters else tuple(TRAITS)
    with sessions() as session:
        api_key = _demo_key(session, data_dir / DEMO_KEY_FILE)
        tenant = get_tenant_by_name(session, name=DEMO_TENANT)
        existing = {a.name for a in list_adapters(session, tenant_id=tenant.id)}
        shipped = {} if random_adapters else trained_adapter_dirs()
        for seed, name in enumerate(names):
            if name in existing:
                continue
            with tempfile.TemporaryDirectory() as tmp:
                if random_adapters:
                    rank, modules = DEMO_ADAPTERS[name]
                    files = save_random_adapter(
                        Path(tmp), shapes, rank=rank, alpha=2 * rank, modules=modules, seed=seed
                    )
                else:
                    files = shipped[name]
                register_adapter_version(
                    session,
                    store,
                    tenant_id=tenant.id,
                    name=name,
                    files_dir=files,
                    validate=validate,
                    base_model=base_model,
                )
            logger.info("registered demo adapter %s", name)
    return DemoInfo(
        tenant_name=DEMO_TENANT,
        api_key=api_key,
        adapter_names=names,
        tenant_id=tenant.id,
        generation_defaults={} if random_adapters else demo_generation_defaults(),
    )
