"""Tests of api/metrics/."""
