"""Tests of api/tenant_adapters/."""
