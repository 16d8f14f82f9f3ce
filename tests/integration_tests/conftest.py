"""Fixtures of the integration suites."""

import pytest

from tests.integration_tests.suite import SeedRuns


@pytest.fixture(scope="session")
def seeds(tmp_path_factory):
    """Single-process seed runs, each run once per session and shared by every suite."""
    return SeedRuns(tmp_path_factory.mktemp("seeds"))
