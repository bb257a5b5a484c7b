"""Alembic revisions for the registry tables (registry/models.py); see registry/README.md."""
