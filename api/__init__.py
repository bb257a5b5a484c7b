"""HTTP serving layer: OpenAI-compatible endpoints, adapter uploads, admin API, CLI (see README.md)."""
