"""``ends_optimizer_step`` / ``starts_optimizer_step`` agree with when Lightning's own loop steps the optimizer."""

import lightning as L
import pytest
import torch
from torch.utils.data import DataLoader, IterableDataset, TensorDataset

from titan_lightning.steps import ends_optimizer_step, starts_optimizer_step


class _Linear(L.LightningModule):
    def __init__(self):
        super().__init__()
        self.layer = torch.nn.Linear(4, 1)
        self.stepped: list[tuple[int, int]] = []  # (epoch, batch_idx) of each real optimizer step

    def training_step(self, batch, batch_idx):
        return self.layer(batch[0]).pow(2).mean()

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.01)

    def optimizer_step(self, epoch, batch_idx, optimizer, optimizer_closure=None):
        self.stepped.append((epoch, batch_idx))
        super().optimizer_step(epoch, batch_idx, optimizer, optimizer_closure)


class _Ask(L.Callback):
    def __init__(self):
        self.ends: list[tuple[int, int]] = []
        self.starts: list[tuple[int, int]] = []

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        if starts_optimizer_step(trainer, batch_idx):
            self.starts.append((trainer.current_epoch, batch_idx))

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if ends_optimizer_step(trainer, batch_idx):
            self.ends.append((trainer.current_epoch, batch_idx))


class _Unsized(IterableDataset):
    """No ``__len__``: Lightning knows the epoch's end only from the exhausted iterator."""

    def __iter__(self):
        return iter([(torch.randn(4),) for _ in range(7)])


@pytest.mark.parametrize("sized", [True, False], ids=["sized", "unsized"])
def test_agrees_with_lightning_at_an_epoch_end(tmp_path, sized):
    # 7 batches an epoch, 3 per step: Lightning steps after batches 2, 5 and the epoch's last, 6.
    data = TensorDataset(torch.randn(7, 4)) if sized else _Unsized()
    module, ask = _Linear(), _Ask()
    trainer = L.Trainer(max_epochs=2, accumulate_grad_batches=3, accelerator="cpu", devices=1,
                        default_root_dir=tmp_path, logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False, callbacks=[ask])
    trainer.fit(module, DataLoader(data, batch_size=None))
    assert module.stepped == [(e, b) for e in (0, 1) for b in (2, 5, 6)]
    assert ask.ends == module.stepped
    # a step starts at each epoch's start and after each step within it
    assert ask.starts == [(e, b) for e in (0, 1) for b in (0, 3, 6)]
