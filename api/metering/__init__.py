"""api/metering: see README.md."""
