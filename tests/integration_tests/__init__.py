"""Integration suites: modules of TestEntry lists; the recipes they run live in recipes/tests/."""

import importlib

from titan_lightning.testing.entries import TestEntry

SUITES = ("features", "models", "h100", "b200")
HARDWARE_SUITES = ("h100", "b200")  # real PG only


def load_suite(name: str) -> list[TestEntry]:
    """The entries of one suite; an unknown name raises ValueError listing the suites."""
    if name not in SUITES:
        raise ValueError(f"unknown test suite {name!r}; expected one of {', '.join(SUITES)}")
    return list(importlib.import_module(f"{__name__}.{name}").ENTRIES)
