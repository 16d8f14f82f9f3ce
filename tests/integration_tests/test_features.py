"""The `features` suite under pytest: every entry in each execution mode it supports (see suite.py)."""

import pytest

from tests.integration_tests.suite import params, run_test


@pytest.mark.parametrize("entry, mode", params("features"))
def test_features(entry, mode, seeds, tmp_path):
    run_test(entry, mode, tmp_path, seeds)
