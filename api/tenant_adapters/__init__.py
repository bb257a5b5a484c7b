"""api/tenant_adapters: see README.md."""
