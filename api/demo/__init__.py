"""api/demo: see README.md."""
