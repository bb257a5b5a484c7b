"""Alembic revisions for the registry tables (registry/tables.py) and `api.py`, which runs them
in-process (upgrade, downgrade, the at-head check); see registry/README.md."""
