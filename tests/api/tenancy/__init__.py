"""Tests of api/tenancy/."""
