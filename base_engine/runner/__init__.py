"""base_engine/runner: see README.md."""
