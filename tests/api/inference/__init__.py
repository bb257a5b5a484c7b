"""Tests of api/inference/."""
