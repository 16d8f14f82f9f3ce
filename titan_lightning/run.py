"""What a recipe returns: a ``Run`` (the module, its data, the Trainer's arguments), and
``RecipeError``. Low in the package (config/ and Lightning's types only), so that every room that
reads a run (trainer.py, pretrained.py, estimate.py) imports it without climbing to recipe.py,
which loads and runs recipes and re-exports both for them."""

from dataclasses import dataclass, field
from typing import Any, Optional

import lightning as L

from titan_lightning.config import JobConfig


class RecipeError(ValueError):
    """A recipe that cannot be loaded or does not return a Run; the message is one line."""


@dataclass(kw_only=True)
class Run:
    """One training run: the module, its data, and the keyword arguments of ``lightning.Trainer``.

    Modules that read a ``JobConfig`` keep it as ``.job``; the module and the data
    module of a run share the same object, so changing a field changes the run.
    """

    module: L.LightningModule
    datamodule: Optional[L.LightningDataModule] = None
    trainer: dict[str, Any] = field(default_factory=dict)
    # Folder name under trainer.default_root_dir; the CLI sets it from the recipe name.
    name: str = "run"
    # Set by check_inputs before launch: the checkpoint fit resumes from (None: a fresh start).
    ckpt_path: Optional[str] = None
    inputs_checked: bool = False
    # The recipe's leave to the run's device to choose the speed settings (device_defaults.for_device:
    # the job as the recipe set it; applied by build_trainer); None: the run trains as set everywhere.
    device_choice: Optional[Any] = None
    # The fields the command line named (job.training.seq_len, trainer.precision): that choice keeps them.
    explicit: set[str] = field(default_factory=set)
    # The command line's run as YAML (what --print_config prints); written to <run folder>/config.yaml
    # at launch, from which generate / chat rebuild the module of a checkpoint. None: not from the CLI.
    config_text: Optional[str] = None

    @property
    def job(self) -> Optional[JobConfig]:
        return getattr(self.module, "job", None)

    def set_job(self, job: JobConfig) -> None:
        """Give the module and the data module a new job config (after overrides)."""
        for part in (self.module, self.datamodule):
            if part is not None and hasattr(part, "job"):
                part.job = job
