"""Integration test entries (torchtitan's OverrideDefinitions) and the fake-PG rules.

An entry names the recipes it runs; the recipes live in ``recipes/tests/<suite>.py`` and
the lists of entries in ``tests/integration_tests/<suite>.py``.
"""

import string
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from titan_lightning.callbacks.golden import hardware_folder
from titan_lightning.recipe import Run, build_run

EXECUTION_MODES = ("fake_pg", "real_pg")
GOLDEN_FIELDS = {"execution_mode", "hardware"}


@dataclass(kw_only=True, frozen=True)
class TestEntry:
    """One end-to-end run (or a save-then-resume pair) of a suite."""

    __test__ = False  # not a pytest test class

    recipes: tuple[str, ...]  # "package.module:function", run in order
    name: str
    description: str
    ngpu: int = 1  # the logical world size
    use_real_pg: bool = False  # needs real communication: never run under the fake group
    # Relative to tests/assets/losses; may contain {execution_mode} and {hardware}: the hardware class's
    # folder ("h200", ...; on CPU one per vendor: "cpu_amd", "cpu_intel", see golden.hardware_folder).
    golden_numerics_path: Optional[str] = None
    seed_recipe: Optional[str] = None  # the one-process run whose losses this must equal
    # How close to the seed run a real-PG run must stay (relative, per step).
    loss_rtol: float = 1e-5
    grad_norm_rtol: float = 1e-4
    timeout: float = 600.0
    disabled: bool = False
    skip_rocm: bool = False

    def __post_init__(self) -> None:
        if not self.recipes or isinstance(self.recipes, str):
            raise ValueError(f"entry {self.name!r}: recipes must be a non-empty tuple of 'module:function'")
        if not self.name.isidentifier():
            raise ValueError(f"entry name {self.name!r} must be an identifier (letters, digits, _)")
        if self.ngpu < 1:
            raise ValueError(f"entry {self.name!r}: ngpu={self.ngpu} must be >= 1")
        if self.golden_numerics_path is not None and len(self.recipes) != 1:
            raise ValueError(
                f"entry {self.name!r}: an entry with golden numerics runs exactly one recipe, got {len(self.recipes)}"
            )
        if self.golden_numerics_path is not None:
            fields = {f for _, f, _, _ in string.Formatter().parse(self.golden_numerics_path) if f is not None}
            if fields - GOLDEN_FIELDS:
                raise ValueError(
                    f"entry {self.name!r}: golden_numerics_path={self.golden_numerics_path!r} uses "
                    f"{sorted(fields - GOLDEN_FIELDS)}; only {{execution_mode}} and {{hardware}} are known"
                )
        if not (self.loss_rtol >= 0 and self.grad_norm_rtol >= 0):
            raise ValueError(f"entry {self.name!r}: loss_rtol and grad_norm_rtol must be >= 0")
        if self.timeout <= 0:
            raise ValueError(f"entry {self.name!r}: timeout={self.timeout} must be > 0")

    def golden_path(self, execution_mode: str, root: Path, hardware: str = "cpu") -> Optional[Path]:
        """The golden file of this entry in one execution mode on one hardware class (on ``cpu``: in
        this CPU vendor's folder; ``other_cpu_goldens`` finds the other vendors')."""
        if execution_mode not in EXECUTION_MODES:
            raise ValueError(f"execution_mode={execution_mode!r} is not one of {', '.join(EXECUTION_MODES)}")
        if self.golden_numerics_path is None:
            return None
        folder = hardware_folder(hardware)
        return root / self.golden_numerics_path.format(execution_mode=execution_mode, hardware=folder)

    def other_cpu_goldens(self, execution_mode: str, root: Path) -> list[Path]:
        """This entry's CPU golden files recorded on other CPU vendors than this one (their folders
        under ``root``), for a run that has none of its own vendor to say why it compares nothing."""
        here = self.golden_path(execution_mode, root)
        if here is None or "{hardware}" not in self.golden_numerics_path:
            return []
        pattern = self.golden_numerics_path.format(execution_mode=execution_mode, hardware="cpu_*")
        return [path for path in sorted(Path(root).glob(pattern)) if path != here and path.is_file()]

    def runs(self) -> list[Run]:
        return [build_run(spec) for spec in self.recipes]


def validate_fake_pg_compatibility(entry: TestEntry) -> None:
    """Refuse what the fake group cannot run unless the entry is marked ``use_real_pg=True``.

    Checkpointing (a save-then-resume pair, or a recipe that keeps checkpointing on),
    pipeline parallelism, and an explicitly non-fake communication backend.
    """
    if entry.use_real_pg:
        return
    if len(entry.recipes) > 1:
        raise ValueError(
            f"entry {entry.name!r} runs {len(entry.recipes)} recipes (save then resume): checkpointing "
            f"cannot run under the fake process group; mark it use_real_pg=True"
        )
    for spec, run in zip(entry.recipes, entry.runs()):
        if run.trainer.get("enable_checkpointing", True):
            raise ValueError(
                f"entry {entry.name!r}: recipe {spec} checkpoints (trainer.enable_checkpointing is not False), "
                f"which cannot run under the fake process group; mark it use_real_pg=True"
            )
        job = run.job
        if job is not None and job.parallelism.pp > 1:
            raise ValueError(
                f"entry {entry.name!r}: recipe {spec} has parallelism.pp={job.parallelism.pp}; pipeline "
                f"parallelism cannot run under the fake process group; mark it use_real_pg=True"
            )
        backend = getattr(run.trainer.get("strategy"), "process_group_backend", None)
        if backend not in (None, "fake"):
            raise ValueError(
                f"entry {entry.name!r}: recipe {spec} asks for the {backend!r} backend explicitly; "
                f"it cannot run under the fake process group; mark it use_real_pg=True"
            )
