"""base_engine/model: see README.md."""
