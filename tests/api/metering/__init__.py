"""Tests of api/metering/."""
