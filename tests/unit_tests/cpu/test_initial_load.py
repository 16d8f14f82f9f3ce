"""A fit that starts from a Hugging Face folder (``checkpoint.initial_load_path``) draws no random init
for the weights the folder overwrites before the first step (an 8B base's draw costs ~a minute of CPU
per run, a 70B's several): plain fine-tuning draws nothing, LoRA its adapters alone; the model then
holds the folder's tensors exactly. A resumed full fine-tune does not load the folder (its checkpoint
replaces every weight), so it draws the init as before. ``validate`` on the folder evaluates the
folder's weights; with a checkpoint (``--ckpt_path``), the checkpoint's."""

from pathlib import Path

import lightning as L
import torch

from titan_lightning.cli import prepare
from titan_lightning.models.common import init
from titan_lightning.recipe import execute
from titan_lightning.trainer import RUN_DIR_ENV

from tests.hf_folders import folder_and_conversations, load_ours


class AtTrainStart(L.Callback):
    """The model's state dict as the first step (or validation batch) sees it (after every on_fit_start,
    after a checkpoint's restore)."""

    def on_train_start(self, trainer, module) -> None:
        self.state = {k: v.detach().clone() for k, v in module.model.state_dict().items()}
        self.init_skipped = module.init_skipped

    def on_validation_start(self, trainer, module) -> None:
        if not trainer.training:
            self.on_train_start(trainer, module)

    def on_train_end(self, trainer, module) -> None:
        self.final = {k: v.detach().clone() for k, v in module.model.state_dict().items()}


def _fit(folder: Path, data: Path, run_dir: Path, monkeypatch, drawn: list, *extra: str,
         recipe: str = "recipes.hf:sft", command: str = "fit", ckpt_path=None) -> AtTrainStart:
    generator = init.param_generator  # (one per parameter drawn)

    def counting(seed, fqn):
        drawn.append(fqn)
        return generator(seed, fqn)

    monkeypatch.setattr(init, "param_generator", counting)
    monkeypatch.setenv(RUN_DIR_ENV, str(run_dir))
    command, run, trainer = prepare([
        command, "--recipe", recipe, "--job.checkpoint.initial_load_path", str(folder), "--job.data.dataset_path",
        str(data), "--trainer.accelerator", "cpu", "--trainer.max_steps", "2", "--trainer.max_epochs", "-1",
        "--trainer.enable_progress_bar", "false", "--job.data.val_fraction", "0" if command == "fit" else "0.25",
        "--job.checkpoint.export_format", "null", "--job.training.tokens_per_step", "256",
        "--job.training.tokens_per_microbatch_per_dp_rank", "128", "--trainer.precision", "32-true", *extra])
    seen = AtTrainStart()
    trainer.callbacks.append(seen)
    if ckpt_path is None:
        execute(command, run, trainer)
    else:  # (the Python API's trainer.validate(..., ckpt_path=...); the CLI's validate takes none)
        trainer.validate(run.module, datamodule=run.datamodule, ckpt_path=ckpt_path)
    return seen


def test_a_fit_from_a_folder_draws_no_init_for_what_it_loads_and_starts_from_the_folder(tmp_path, monkeypatch):
    folder, data = folder_and_conversations(tmp_path, "qwen3")
    want = load_ours(folder).state_dict()

    drawn = []
    sft = _fit(folder, data, tmp_path / "sft", monkeypatch, drawn, "--job.checkpoint.interval", "2")
    assert sft.init_skipped and drawn == []
    assert sft.state.keys() == want.keys()
    assert all(torch.equal(sft.state[k], want[k]) for k in want)

    drawn = []
    lora = _fit(folder, data, tmp_path / "lora", monkeypatch, drawn, recipe="recipes.hf:lora")
    assert lora.init_skipped and drawn and all(".lora_a." in fqn or ".lora_b." in fqn for fqn in drawn)
    assert len(drawn) == 2 * sum(".lora_a." in k for k in lora.state)  # (every adapter's A and B, nothing else)
    assert all(torch.equal(lora.state[k], want[k]) for k in want)  # the base is the folder's

    # A resumed full fine-tune: the checkpoint holds every weight, the folder is not read again
    drawn = []
    checkpoint = tmp_path / "sft" / "checkpoints" / "epoch=0-step=2.ckpt"
    resumed = _fit(folder, data, tmp_path / "resumed", monkeypatch, drawn, "--trainer.max_steps", "3",
                   "--job.checkpoint.resume_from", str(checkpoint))
    assert not resumed.init_skipped and len(drawn) == len([k for k in want if not k.endswith("rope_cache")])

    # validate on the folder alone: its weights, none drawn; with the fine-tune's checkpoint: the checkpoint's
    drawn = []
    base = _fit(folder, data, tmp_path / "validate", monkeypatch, drawn, "--trainer.max_steps", "-1",
                command="validate")
    assert drawn == [] and all(torch.equal(base.state[k], want[k]) for k in want)
    drawn = []
    tuned = _fit(folder, data, tmp_path / "validate_ckpt", monkeypatch, drawn, "--trainer.max_steps", "-1",
                 command="validate", ckpt_path=str(checkpoint))
    assert all(torch.equal(tuned.state[k], sft.final[k]) for k in want)
    assert any(not torch.equal(tuned.state[k], want[k]) for k in want)  # (two steps moved the weights)
