"""Tests of api/http/."""
