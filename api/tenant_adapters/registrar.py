"""What registering an adapter (multipart upload or import by reference) works with, built once at
start-up and handed to the routes: the database and object store it writes to, the validator bound to
the served base model, the upload slots and pool, and the size and time limits."""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import Executor
from dataclasses import dataclass
from pathlib import Path

from sqlalchemy.orm import Session, sessionmaker

from adapters.types import AdapterSummary
from api.tenant_adapters.upload_gate import TenantUploadGate
from api.tenant_adapters.uploads import UploadLimits
from api.tenant_adapters.views import Residency
from registry.store import ObjectStore


@dataclass(frozen=True, slots=True)
class Registrar:
    sessions: sessionmaker[Session]
    store: ObjectStore  # the registry's store: where registered versions are kept
    validate: Callable[[Path], AdapterSummary]  # fail-closed, against the served base model
    base_model: str  # the served base model's name, recorded with each version
    residency: Residency  # for the views answered once a version is registered
    gate: TenantUploadGate  # `max_concurrent_uploads` registrations at once, fewer of one tenant
    pool: Executor  # the upload pool: validation, object store and database work
    limits: UploadLimits
    uploads_dir: Path  # private temporary directories of registrations in progress
    timeout_s: float  # `upload_timeout_s`: how long a request waits for its worker (then 504)
