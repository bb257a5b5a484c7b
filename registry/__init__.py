"""Adapter registry: content-addressed object store (S3 / local), SQL metadata (tenants, keys,
adapter versions, usage, audit) with Alembic migrations, and the local disk tier. See README.md."""
