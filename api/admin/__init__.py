"""api/admin: see README.md."""
