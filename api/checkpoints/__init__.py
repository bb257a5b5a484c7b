"""api/checkpoints: see README.md."""
