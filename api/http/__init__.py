"""api/http: see README.md."""
