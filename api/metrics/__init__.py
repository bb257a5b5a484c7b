"""api/metrics: see README.md."""
