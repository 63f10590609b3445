"""Hypothesis settings shared by tests/unit/test_fuzz_*.py: bounded and derandomized, so that the
fuzz tests together stay well under a minute on CI and never flake on a new example."""

from __future__ import annotations

from hypothesis import HealthCheck, settings

FUZZ = settings(
    max_examples=150,
    deadline=None,  # a slow CI machine must not fail an example on time alone
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
    derandomize=True,
    database=None,
)
