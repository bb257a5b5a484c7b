"""Tests of api/admin/."""
