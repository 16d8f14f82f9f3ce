"""Every integration entry is well formed: unique names, valid recipes, ngpu = degrees, goldens present."""

from pathlib import Path

import pytest

from titan_lightning.config import validate_job
from titan_lightning.parallel.mesh import ParallelDims
from titan_lightning.testing.entries import TestEntry, validate_fake_pg_compatibility

from tests.integration_tests import HARDWARE_SUITES, SUITES, load_suite

ASSETS = Path(__file__).resolve().parents[2] / "assets" / "losses"
ENTRIES = [(suite, e) for suite in SUITES for e in load_suite(suite)]
CPU_VENDOR_FOLDERS = ("cpu_amd", "cpu_intel")  # the CPU vendors whose goldens are committed


def test_the_committed_cpu_goldens_are_the_named_vendors_folders():
    for mode in ("fake_pg", "real_pg"):
        assert sorted(p.name for p in (ASSETS / mode).glob("cpu*")) == list(CPU_VENDOR_FOLDERS)


def test_the_vendors_folders_hold_the_goldens_of_entries_alone():
    """A golden file no entry names (a renamed or removed entry) is not left behind in any vendor's folder."""
    named = {entry.golden_numerics_path.format(execution_mode=mode, hardware=vendor)
             for _, entry in ENTRIES if entry.golden_numerics_path
             for mode in ("fake_pg", "real_pg") for vendor in CPU_VENDOR_FOLDERS}
    for vendor in CPU_VENDOR_FOLDERS:
        for path in ASSETS.glob(f"*/{vendor}/*"):
            assert str(path.relative_to(ASSETS)) in named, f"{path} belongs to no entry"


def test_names_are_unique_within_each_suite():
    for suite in SUITES:
        names = [e.name for s, e in ENTRIES if s == suite]
        assert len(names) == len(set(names)), suite


@pytest.mark.parametrize("suite, entry", ENTRIES, ids=[f"{s}-{e.name}" for s, e in ENTRIES])
def test_entry_recipes_are_valid_and_ngpu_is_the_product_of_degrees(suite, entry):
    assert all(spec.startswith(f"recipes.tests.{suite}:") for spec in entry.recipes), "recipes live in recipes/tests/<suite>.py"
    for run in entry.runs():
        validate_job(run.job, world_size=entry.ngpu, max_steps=run.trainer["max_steps"])
        dims = ParallelDims.from_config(run.job.parallelism, entry.ngpu)
        assert dims.pp * dims.dp_replicate * dims.dp_shard * dims.cp * dims.tp == entry.ngpu
    if entry.seed_recipe is not None:
        seed = TestEntry(recipes=(entry.seed_recipe,), name="seed", description="").runs()[0]
        validate_job(seed.job, world_size=1, max_steps=seed.trainer["max_steps"])
    for mode in ("fake_pg", "real_pg"):
        if entry.golden_path(mode, ASSETS) is None or (mode == "fake_pg" and entry.use_real_pg):
            continue
        # Some CPU vendor's folder holds it (a host records its own vendor's; a vendor without the file,
        # e.g. after another vendor's re-export changed the numbers, checks two exports against each other).
        paths = [ASSETS / entry.golden_numerics_path.format(execution_mode=mode, hardware=vendor)
                 for vendor in CPU_VENDOR_FOLDERS]
        assert any(path.exists() for path in paths), f"no CPU golden file of entry {entry.name}: {paths}"
    if suite in HARDWARE_SUITES:
        assert entry.use_real_pg, f"hardware suite {suite} runs real PG only: mark {entry.name} use_real_pg=True"
    if not entry.use_real_pg:
        validate_fake_pg_compatibility(entry)


def test_every_suite_has_entries_and_an_unknown_suite_is_named():
    assert all(load_suite(suite) for suite in SUITES)
    with pytest.raises(ValueError, match=r"unknown test suite 'nope'; expected one of features, models, h100, b200"):
        load_suite("nope")


def _entry(**kwargs):
    defaults = dict(recipes=("recipes.tests.features:llama3_debugmodel",), name="e", description="d")
    return TestEntry(**{**defaults, **kwargs})


def test_fake_pg_refuses_checkpointing_save_resume_and_pipeline(monkeypatch):
    with pytest.raises(ValueError, match=r"runs 2 recipes \(save then resume\).*mark it use_real_pg=True"):
        validate_fake_pg_compatibility(_entry(recipes=("recipes.tests.features:llama3_debugmodel",) * 2))
    validate_fake_pg_compatibility(_entry(recipes=("recipes.tests.features:llama3_debugmodel",) * 2, use_real_pg=True))
    with pytest.raises(ValueError, match=r"recipe recipes.llama3:debugmodel checkpoints"):
        validate_fake_pg_compatibility(_entry(recipes=("recipes.llama3:debugmodel",)))

    from recipes.tests import features

    def piped():
        run = features.llama3_debugmodel()
        run.job.parallelism.pp = 2
        return run

    monkeypatch.setattr(features, "llama3_piped", piped, raising=False)
    with pytest.raises(ValueError, match=r"parallelism.pp=2; pipeline parallelism cannot run under the fake process group"):
        validate_fake_pg_compatibility(_entry(recipes=("recipes.tests.features:llama3_piped",)))

    def gloo():
        from titan_lightning.strategies import TitanStrategy

        run = features.llama3_debugmodel()
        run.trainer["strategy"] = TitanStrategy(process_group_backend="gloo")
        return run

    monkeypatch.setattr(features, "llama3_gloo", gloo, raising=False)
    with pytest.raises(ValueError, match=r"asks for the 'gloo' backend explicitly"):
        validate_fake_pg_compatibility(_entry(recipes=("recipes.tests.features:llama3_gloo",)))


def test_entry_rules():
    with pytest.raises(ValueError, match=r"runs exactly one recipe, got 2"):
        _entry(recipes=("a:b", "c:d"), golden_numerics_path="x.txt")
    with pytest.raises(ValueError, match=r"entry name 'a-b' must be an identifier"):
        _entry(name="a-b")
    assert _entry(golden_numerics_path="{execution_mode}/x.txt").golden_path("real_pg", Path("/g")) == Path("/g/real_pg/x.txt")
