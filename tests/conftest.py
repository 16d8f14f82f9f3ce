"""Shared test hygiene."""

import os
import sys

# Before anything imports torch and runs a kernel: the CPU kernel paths golden numbers are
# recorded with (see titan_lightning/testing/launch.py). That module imports no torch.
# Inductor's cache too: kept apart from unpinned processes' (portable_cpu_env says why).
from titan_lightning.testing.launch import portable_cpu_env

for _key, _value in portable_cpu_env().items():
    os.environ.setdefault(_key, _value)

import pytest  # noqa: E402

# Set by Lightning or torch.distributed inside a test process (e.g. MASTER_PORT picked by
# LightningEnvironment); a later test's subprocesses must not inherit them.
DISTRIBUTED_ENV = ("MASTER_ADDR", "MASTER_PORT", "RANK", "LOCAL_RANK", "WORLD_SIZE", "NODE_RANK", "GROUP_RANK",
                   "LOCAL_WORLD_SIZE", "GROUP_WORLD_SIZE")


def _end_process_group() -> None:
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()


@pytest.fixture(scope="module", autouse=True)
def _module_environment():
    """The same around each module, before its module-scoped fixtures start anything (they inherit
    this process's environment: a MASTER_PORT left by an earlier module's run, whose process group
    still holds the port, would make their subprocesses fail to bind it)."""
    _end_process_group()
    saved = dict(os.environ)
    for name in DISTRIBUTED_ENV:
        os.environ.pop(name, None)
    yield
    _end_process_group()
    os.environ.clear()
    os.environ.update(saved)
    _reset_compiled()


def _reset_compiled() -> None:
    """Dynamo's compiled code and guards dropped after each module: one process compiles one model
    (a block's forward, a few guard sets); a test process compiles one module's models after
    another's, which on the same code objects would reach Dynamo's recompile limit and fail a
    ``fullgraph`` compile depending on the order tests run in. (Inductor's cache on disk stays.)"""
    if "torch._dynamo" in sys.modules:
        sys.modules["torch._dynamo"].reset()


@pytest.fixture(autouse=True)
def _restore_environment():
    saved = dict(os.environ)
    for name in DISTRIBUTED_ENV:
        os.environ.pop(name, None)
    yield
    os.environ.clear()
    os.environ.update(saved)
    # A Trainer run in this process leaves its process group up (as Lightning's strategies do, for what
    # comes after fit); the next test starts without one.
    _end_process_group()


def pytest_collection_modifyitems(config, items):
    """``gpu`` tests need a visible GPU, ``multi_gpu`` tests two: skipped, with the reason, otherwise."""
    import torch

    count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    for item in items:
        if "multi_gpu" in item.keywords and count < 2:
            item.add_marker(pytest.mark.skip(reason=f"needs several GPUs, {count} visible"))
        elif "gpu" in item.keywords and count < 1:
            item.add_marker(pytest.mark.skip(reason="needs a GPU, none visible"))


# -- worker processes (pytest-xdist; pyproject's addopts ask for "auto") ---------------------------
XDIST_WORKERS = 2


def pytest_xdist_auto_num_workers(config):
    """Two workers on a machine of 2+ cores: the suite's multi-rank runs and time limits are sized for
    2 cores, and one pytest process leaves ~40% of them idle. One process (0) where a GPU is visible
    (its tests time kernels, two at once would share the device), under -s (output shown as it comes),
    or on one core; PYTEST_XDIST_AUTO_NUM_WORKERS, or -n N on the command line, decides otherwise."""
    if os.environ.get("PYTEST_XDIST_AUTO_NUM_WORKERS"):
        return int(os.environ["PYTEST_XDIST_AUTO_NUM_WORKERS"])
    if config.getoption("capture") == "no" or (os.cpu_count() or 1) < 2:
        return 0
    import torch  # (after the cheap answers: pytest's own start-up imports no torch for them)

    return 0 if torch.cuda.is_available() else XDIST_WORKERS


# -- the time guard ---------------------------------------------------------------------------
# A test (setup + call + teardown: a module fixture's reference run counts for the first test
# that uses it) taking longer than this without @pytest.mark.slow fails: the suite has a time
# budget (CI <= 25 min on 2 cores), and a long test must say so. Every test over it is listed at
# the end of the run, slow or not. Beside another worker a test shares the cores: its bound
# scales with the workers (a test's own cost is what the guard is for, not its neighbour's).
ALONE_S = float(os.environ.get("TITAN_LIGHTNING_SLOW_TEST_S", "60"))
SLOW_TEST_S = ALONE_S * max(1, int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1")))
_reported: dict = {}  # (each test's phases so far; in the process that prints the summary, every worker's)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    report = outcome.get_result()
    total = _reported.get(item.nodeid, 0.0) + report.duration  # (its earlier phases were logged already)
    if report.when != "teardown" or report.outcome != "passed" or total <= SLOW_TEST_S:
        return
    if item.get_closest_marker("slow") is None:
        report.outcome = "failed"
        report.longrepr = (f"{item.nodeid} took {total:.0f} s (over {SLOW_TEST_S:.0f} s) and is not marked "
                           f"@pytest.mark.slow: make it faster (smaller shapes, fewer steps, a shared reference run) "
                           f"or mark it slow")


def pytest_runtest_logreport(report):
    _reported[report.nodeid] = _reported.get(report.nodeid, 0.0) + report.duration


def pytest_terminal_summary(terminalreporter):
    over = sorted(((t, nodeid) for nodeid, t in _reported.items() if t > ALONE_S), reverse=True)
    if over:
        terminalreporter.write_sep("=", f"tests over {ALONE_S:.0f} s (setup + call + teardown)")
        for seconds, nodeid in over:
            terminalreporter.write_line(f"{seconds:7.1f} s  {nodeid}")
