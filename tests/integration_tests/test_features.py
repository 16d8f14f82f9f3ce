"""The `features` suite under pytest: every entry in each execution mode it supports (see suite.py)."""

import pytest

from tests.integration_tests.suite import SeedRuns, params, run_test


@pytest.fixture(scope="module")
def seeds(tmp_path_factory):
    return SeedRuns(tmp_path_factory.mktemp("seeds"))


@pytest.mark.parametrize("entry, mode", params("features"))
def test_features(entry, mode, seeds, tmp_path):
    run_test(entry, mode, tmp_path, seeds)
