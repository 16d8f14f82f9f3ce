"""Parametrize a suite's entries over execution modes, and run one (entry, mode) as a pytest test.

- fake PG: in this process, ``FakePGStrategy(world_size=ngpu)``; marker ``fake_pg``.
- real PG: one process per rank through titan_lightning.testing.launch (with the entry's
  timeout); markers ``real_pg`` and ``multi_process``, plus ``multi_gpu`` on a GPU machine when
  ngpu > 1. On CPU (gloo) every entry fits; the whole features suite is a few minutes.

The accelerator is the GPU when one is visible, unless TITAN_LIGHTNING_TEST_ACCELERATOR=cpu.
A real-PG run with a seed recipe must stay within the entry's tolerances of the seed run.
"""

import os
import warnings
from pathlib import Path
from typing import Optional

import pytest

from tests.integration_tests import HARDWARE_SUITES, load_suite
from titan_lightning.testing.entries import TestEntry
from titan_lightning.testing.integration import EntryResult, run_entry

ACCELERATOR_ENV = "TITAN_LIGHTNING_TEST_ACCELERATOR"


def accelerator() -> str:
    forced = os.environ.get(ACCELERATOR_ENV)
    if forced:
        return forced
    import torch

    return "gpu" if torch.cuda.is_available() else "cpu"


def params(suite: str) -> list:
    """pytest params ``(entry, mode)`` for every runnable pair of ``suite``; disabled entries are left out."""
    on_gpu = accelerator() != "cpu"
    result = []
    for entry in load_suite(suite):
        if entry.disabled:
            continue
        modes = ["real_pg"] if entry.use_real_pg or suite in HARDWARE_SUITES else ["fake_pg", "real_pg"]
        for mode in modes:
            marks = [getattr(pytest.mark, mode)]
            if mode == "real_pg":
                marks.append(pytest.mark.multi_process)
                if entry.ngpu >= 4:  # 4-8 ranks on 2 cores: 30-80 s each (see the time guard in tests/conftest.py)
                    marks.append(pytest.mark.slow)
                if on_gpu and entry.ngpu > 1:
                    marks.append(pytest.mark.multi_gpu)
                if suite in HARDWARE_SUITES:
                    marks.append(pytest.mark.gpu)
            if suite in HARDWARE_SUITES:
                marks.append(_hardware_mark(suite))
            result.append(pytest.param(entry, mode, marks=marks, id=f"{entry.name}-{mode}"))
    return result


# Compute capability major version of each hardware suite's GPUs: Hopper 9, Blackwell 10.
HARDWARE_CAPABILITY = {"h100": 9, "b200": 10}


def _hardware_mark(suite: str):
    import torch

    wanted = HARDWARE_CAPABILITY[suite]
    found = torch.cuda.get_device_capability(0)[0] if torch.cuda.is_available() else None
    return pytest.mark.skipif(found != wanted, reason=f"the {suite} suite needs compute capability {wanted}.x, found {found}")


def gpu_env(ngpu: int) -> Optional[dict]:
    """Real PG on GPU: the first ``ngpu`` visible devices (the launcher hides GPUs by default)."""
    if accelerator() == "cpu":
        return None
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    devices = visible.split(",") if visible else [str(i) for i in range(ngpu)]
    return {"CUDA_VISIBLE_DEVICES": ",".join(devices[:ngpu])}


class SeedRuns:
    """Seed (single-process) runs, each run once per test session."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.results: dict[str, dict] = {}

    def get(self, recipe: str) -> dict:
        if recipe not in self.results:
            seed = TestEntry(recipes=(recipe,), name="seed", description="the seed run", timeout=600)
            where = self.root / recipe.replace(":", "_").replace(".", "_")
            self.results[recipe] = run_entry(seed, "real_pg", where, accelerator=accelerator(), env=gpu_env(1)).ranks[0]
        return self.results[recipe]


def run_test(entry: TestEntry, mode: str, out_dir: Path, seeds: SeedRuns) -> EntryResult:
    """Run ``entry`` in ``mode`` (golden compared where it has one) and check what every rank reports."""
    if accelerator() != "cpu" and mode == "real_pg" and entry.ngpu > _gpu_count():
        # NCCL needs one GPU per rank; fewer are visible (only reachable when multi_gpu tests are selected
        # on a machine with 2..ngpu-1 GPUs: conftest skips multi_gpu below 2).
        pytest.skip(f"{entry.name} needs {entry.ngpu} GPUs, {_gpu_count()} visible")
    result = run_entry(entry, mode, out_dir, accelerator=accelerator(), in_process=mode == "fake_pg",
                       env=gpu_env(entry.ngpu))
    if result.golden_status in ("missing", "not_comparable"):
        why = "recorded on another torch or CPU" if result.golden_status == "not_comparable" else "missing"
        message = (f"{entry.name}: the {mode} golden {result.golden} is {why}, not compared; export it with "
                   f"python -m tests.integration_tests.run_tests OUT --test_name {entry.name} "
                   f"--execution_mode {mode} --export-numerics")
        if accelerator() == "cpu" and result.golden_status == "missing":  # CI's class: its goldens are committed
            pytest.fail(message)
        warnings.warn(message)
    first = result.ranks[0]
    assert first["losses"], f"{entry.name}: no optimizer step ran"
    for rank in result.ranks:
        assert rank["world_size"] == entry.ngpu
        # Every rank logs the same global loss and grad norm.
        assert rank["losses"] == first["losses"], f"rank {rank['rank']} logged other losses than rank 0"
        assert rank["grad_norms"] == first["grad_norms"], f"rank {rank['rank']} logged other grad norms than rank 0"
    if mode == "real_pg" and entry.seed_recipe is not None:
        compare_with_seed(entry, first, seeds.get(entry.seed_recipe))
    return result


def compare_with_seed(entry: TestEntry, got: dict, seed: dict) -> None:
    assert len(got["losses"]) == len(seed["losses"]), f"{entry.name}: {len(got['losses'])} steps, seed ran {len(seed['losses'])}"
    for name, singular, rtol in (("losses", "loss", entry.loss_rtol), ("grad_norms", "grad_norm", entry.grad_norm_rtol)):
        for step, (value, reference) in enumerate(zip(got[name], seed[name]), start=1):
            error = abs(value - reference) / max(abs(reference), 1e-12)
            assert error <= rtol, (
                f"{entry.name} step {step}: {singular} {value!r} vs seed run {entry.seed_recipe} {reference!r} "
                f"(relative {error:.2e} > {rtol:.0e})"
            )


def _gpu_count() -> int:
    import torch

    return torch.cuda.device_count()
