"""Tests of api/checkpoints/."""
