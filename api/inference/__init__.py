"""api/inference: see README.md."""
