"""base_engine/testing: see README.md."""
