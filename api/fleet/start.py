"""What a fleet replica (`loraserve serve --fleet`) needs before it starts, checked before anything.

A fleet shares its state through PostgreSQL + S3: quotas, console sessions, usage and adapters live
there, so every replica must point at the same database and object store; SQLite and a local
`file://` store are the single-process default and cannot be shared. Migrations run once per deploy
(`loraserve db upgrade`), never raced by replica starts, and secrets come from the deploy: a replica
never generates an admin key into its data dir (each replica would invent its own).
"""

from __future__ import annotations

import hashlib
import hmac

from sqlalchemy.engine import make_url

from api.settings import Settings
from migrations.api import SchemaNotAtHead, check_at_head

WHY = "a fleet shares its state through PostgreSQL + S3; SQLite/local store is the single-process default"


class FleetStartError(RuntimeError):
    """This replica cannot join a fleet as configured; the message names each problem and the fix."""


def fleet_problems(settings: Settings) -> list[str]:
    """What keeps `settings` from running as a fleet replica (empty when nothing does)."""
    problems = []
    backend = make_url(settings.db_url).get_backend_name()
    if backend != "postgresql":
        given = "not given (SQLite in the data dir)" if settings.db is None else f"a {backend} URL"
        problems.append(
            f"--db / LORASERVE_DB must be a PostgreSQL URL (postgresql+psycopg://user@host/db), got {given}"
        )
    if not settings.registry_url.startswith("s3://"):
        scheme = settings.registry_url.split("://", 1)[0]
        given = "not given (file:// in the data dir)" if settings.registry is None else f"a {scheme}:// store"
        problems.append(f"--registry / LORASERVE_REGISTRY must be s3://bucket/prefix, got {given}")
    if settings.admin_key is None:
        problems.append(
            "the admin key must be provided (LORASERVE_ADMIN_KEY, the same for every replica): "
            "a replica never generates one into its data dir"
        )
    if settings.metrics_tenant_labels and settings.metrics_token is None:
        problems.append(
            "metrics tenant labels need a provided metrics token (LORASERVE_METRICS_TOKEN, the same for "
            "every replica)"
        )
    return problems


def check_fleet_settings(settings: Settings) -> None:
    """Raise FleetStartError naming every problem when `settings.fleet` is on; else do nothing."""
    if not settings.fleet:
        return
    problems = fleet_problems(settings)
    if problems:
        lines = "\n".join(f"  - {p}" for p in problems)
        raise FleetStartError(f"cannot start as a fleet replica ({WHY}):\n{lines}")


def check_fleet_schema(settings: Settings) -> None:
    """A replica never migrates: the deploy ran `loraserve db upgrade` once, or the replica refuses."""
    try:
        check_at_head(settings.db_url)
    except SchemaNotAtHead as exc:
        db = make_url(settings.db_url).render_as_string(hide_password=True)
        raise FleetStartError(
            f"cannot start as a fleet replica: {exc}. Replicas never migrate the shared database; "
            f"run `loraserve db upgrade --db {db}` once per deploy, then start the replicas."
        ) from None


def fleet_server_secret(admin_key: str) -> str:
    """The prefix-cache salt secret of a fleet: derived from the provided admin key, so every replica
    has the same one without a file per replica (api/tenancy/keyfiles.py keeps it in the data dir
    otherwise)."""
    return hmac.new(admin_key.encode(), b"loraserve server secret", hashlib.sha256).hexdigest()
