"""api/tenancy: see README.md."""
