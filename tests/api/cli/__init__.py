"""Tests of api/cli/."""
