"""api/cli: see README.md."""
