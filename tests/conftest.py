"""Shared test hygiene."""

import os

import pytest

# Set by Lightning or torch.distributed inside a test process (e.g. MASTER_PORT picked by
# LightningEnvironment); a later test's subprocesses must not inherit them.
DISTRIBUTED_ENV = ("MASTER_ADDR", "MASTER_PORT", "RANK", "LOCAL_RANK", "WORLD_SIZE", "NODE_RANK", "GROUP_RANK",
                   "LOCAL_WORLD_SIZE", "GROUP_WORLD_SIZE")


@pytest.fixture(autouse=True)
def _restore_environment():
    saved = dict(os.environ)
    for name in DISTRIBUTED_ENV:
        os.environ.pop(name, None)
    yield
    os.environ.clear()
    os.environ.update(saved)
