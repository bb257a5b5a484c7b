"""Every registry table on one metadata: what Alembic compares revisions against and `create_all` builds.

The tables live in one module per idea (models.py: tenants, keys, adapters, usage, audit;
fleet_models.py: fleet membership; fleet_state_models.py: fleet-wide quota and console state;
import_models.py: per-tenant import allowlists and source claims; response_models.py: stored
responses), all
on `models.Base`. Importing this module imports each of them, so `metadata` is whole.
"""

from __future__ import annotations

from sqlalchemy import MetaData

from registry import fleet_models, fleet_state_models, import_models, models, response_models

TABLE_MODULES = (models, fleet_models, fleet_state_models, import_models, response_models)

metadata: MetaData = models.Base.metadata
