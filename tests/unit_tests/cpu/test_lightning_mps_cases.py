"""Lightning's own ModelParallelStrategy integration tests (rewritten for CPU/gloo in
lightning_mps_cases.py, source named there) pass with ``TitanStrategy`` swapped in.

Every case of one world size runs in one launch, one after the other in the same processes: a
second ``fit`` (and ``validate``, ``save_checkpoint``, ``full_tensor()``) after the first, in the
process group the first left up, is under test too. ModelParallelStrategy itself passes them all
(``python -m pytest ... --mps`` is not offered: run the module by hand with ``mps`` to see it).
"""

from pathlib import Path

import pytest

from titan_lightning.testing.launch import LaunchError, launch, pythonpath_env

import lightning_mps_cases as cases

HERE = Path(__file__).parent
ENV = pythonpath_env(HERE)
ONE_RANK = {"test_model_parallel_single_file_checkpoint_with_compile"}
FOUR_RANKS = {"test_setup_device_mesh", "test_fsdp2_tensor_parallel", "test_fsdp2_tensor_parallel_compile"}


def _world_size(case: str) -> int:
    return 1 if case in ONE_RANK else 4 if case in FOUR_RANKS else 2


@pytest.fixture(scope="module")
def results(tmp_path_factory) -> dict:
    """{case: [per-rank outcome]} for every case, one launch per world size."""
    outcomes: dict = {}
    for world_size in (1, 2, 4):
        names = [name for name in cases.cases() + cases.crossing_cases() if _world_size(name) == world_size]
        out = tmp_path_factory.mktemp(f"mps_cases_{world_size}")
        try:
            ranks = launch(["titan", *names], world_size, out_dir=out, timeout=240, module="lightning_mps_cases",
                           env=ENV).ranks
        except LaunchError as error:  # (a case that hangs: what the ranks wrote up to then, the rest missing)
            ranks = error.result.ranks
            print(error)
        for name in names:
            outcomes[name] = [(rank or {}).get("results", {}).get(name, "missing (the launch ended first)")
                              for rank in ranks]
    return outcomes


def test_every_case_of_lightning_is_here():
    assert len(cases.cases()) == 18


@pytest.mark.multi_process
@pytest.mark.slow
@pytest.mark.parametrize("case", cases.cases())
def test_lightning_model_parallel_integration_case_passes_with_titan_strategy(case, results):
    _assert_passed(results, case)


@pytest.mark.multi_process
@pytest.mark.slow
@pytest.mark.parametrize("case", cases.crossing_cases())
def test_checkpoints_cross_between_model_parallel_strategy_and_titan_strategy(case, results):
    """A sharded checkpoint of either resumes under the other and continues as under the first."""
    _assert_passed(results, case)


def _assert_passed(results: dict, case: str) -> None:
    failures = [outcome for outcome in results[case] if outcome != "passed"]
    assert not failures, failures[0]
