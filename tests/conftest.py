"""Shared test hygiene."""

import os

# Before anything imports torch and runs a kernel: the CPU kernel paths golden numbers are
# recorded with (see titan_lightning/testing/launch.py). That module imports no torch.
from titan_lightning.testing.launch import PORTABLE_CPU_ENV

for _key, _value in PORTABLE_CPU_ENV.items():
    os.environ.setdefault(_key, _value)

import pytest  # noqa: E402

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


def pytest_collection_modifyitems(config, items):
    """``gpu`` tests need a visible GPU, ``multi_gpu`` tests two: skipped, with the reason, otherwise."""
    import torch

    count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    for item in items:
        if "multi_gpu" in item.keywords and count < 2:
            item.add_marker(pytest.mark.skip(reason=f"needs several GPUs, {count} visible"))
        elif "gpu" in item.keywords and count < 1:
            item.add_marker(pytest.mark.skip(reason="needs a GPU, none visible"))
