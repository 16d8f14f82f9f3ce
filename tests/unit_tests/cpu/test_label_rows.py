"""The head on the labelled rows alone (``label_rows``, CausalLMModule.prepare_batch_on_host): where a
batch's tokens are partly unlabelled (fine-tuning's prompts, preference pairs' prompts), the host
finds the labelled rows before the transfer and the head's matmuls and the cross entropy run on those
alone; the loss and every gradient are the full batch's (fp32, within 1e-6), on the plain and the
chunked loss (whose chunks keep the batch's chunk size: the kernels compiled for it see no new
shape), for each reduction; a pretraining batch, and tensor, context or pipeline parallelism, keep
the full rows. A run through the data module (SFT, one process) trains as without them."""

import csv
from pathlib import Path

import pytest
import torch

import titan_lightning.models.causal_lm as causal_lm
from recipes.tests import features
from titan_lightning.models.common import loss as loss_module
from titan_lightning.models.common.loss import IGNORE_INDEX

from tests.hf_folders import folder_and_conversations


def _module(loss_chunks=None, **degrees):
    run = features.llama3_small()
    run.job.training.loss_chunks = loss_chunks
    for name, value in degrees.items():
        setattr(run.job.parallelism, name, value)
    module = run.module
    with torch.device("meta"):
        module.model = module.build_model()
    module.materialize(torch.device("cpu"))
    return module


def _batch(module, labelled_share: float = 0.4, seed: int = 0) -> dict:
    t, vocab = module.job.training, module.job.model.vocab_size
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, vocab, (t.microbatch_size, t.seq_len), generator=g)
    labels = torch.randint(0, vocab, tokens.shape, generator=g)
    labels[torch.rand(tokens.shape, generator=g) > labelled_share] = IGNORE_INDEX  # (the prompts)
    return {"input_ids": tokens, "labels": labels}


def test_the_host_finds_the_labelled_rows_of_a_fine_tuning_batch_and_leaves_other_batches_whole():
    module = _module()
    batch = _batch(module)
    prepared = module.prepare_batch_on_host(batch)
    rows = prepared["label_rows"]
    assert rows.dtype == torch.int64 and rows.device.type == "cpu"
    assert torch.equal(rows, (batch["labels"].flatten() != IGNORE_INDEX).nonzero().flatten())
    assert set(batch) == {"input_ids", "labels"}  # (the loader's batch is not changed)
    pretraining = _batch(module, labelled_share=1.0)
    pretraining["labels"][:, -1] = IGNORE_INDEX  # (a document's last token: 97% labelled)
    assert "label_rows" not in module.prepare_batch_on_host(pretraining)
    nothing = _batch(module, labelled_share=0.0)
    assert "label_rows" not in module.prepare_batch_on_host(nothing)
    for degrees in ({"tp": 2}, {"cp": 2}, {"pp": 2}):  # (their head sees other rows, or a microbatch)
        assert "label_rows" not in _module(**degrees).prepare_batch_on_host(batch)


def _loss_and_grads(module, batch, reduction: str):
    module.model.zero_grad()
    output = module._batch_input(batch)
    losses = module.objective.batch_loss(output, batch, reduction)
    weights = torch.linspace(0.5, 1.5, losses.numel()).view(losses.shape)  # (each token's loss counts)
    (losses * weights).sum().backward()
    return losses.detach(), {n: p.grad.clone() for n, p in module.model.named_parameters()}


@pytest.mark.parametrize("loss_chunks", [None, 3])
@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
def test_the_loss_and_every_gradient_over_the_labelled_rows_are_the_full_batchs(loss_chunks, reduction, monkeypatch):
    module = _module(loss_chunks)
    batch = _batch(module)
    full_loss, full_grads = _loss_and_grads(module, batch, reduction)
    shapes = []
    kernels = loss_module._kernels(False)
    monkeypatch.setattr(loss_module, "_kernels", lambda compiled: (
        lambda x, *args: shapes.append(tuple(x.shape)) or kernels[0](x, *args), kernels[1]))
    prepared = module.prepare_batch_on_host(batch)
    rows_loss, rows_grads = _loss_and_grads(module, prepared, reduction)
    assert rows_loss.shape == full_loss.shape
    torch.testing.assert_close(rows_loss, full_loss, rtol=1e-6, atol=1e-6)
    for name, grad in full_grads.items():  # (sums over other rows: within 1e-6 of each gradient's largest value)
        torch.testing.assert_close(rows_grads[name], grad, rtol=0, atol=1e-6 * grad.abs().max().item(),
                                   msg=lambda m: f"{name}: {m}")
    if loss_chunks is not None:  # whole chunks of the batch's chunk size, as many as the labelled rows fill
        tokens, labelled = batch["labels"].numel(), prepared["label_rows"].numel()
        size = -(-tokens // loss_chunks)
        assert shapes == [(size, module.job.model.dim)] * -(-labelled // size)


def test_a_fine_tuning_run_through_the_data_module_trains_as_on_the_full_rows(tmp_path, monkeypatch):
    """``recipes.hf:sft`` on a folder's conversations (their second halves supervised), one process:
    the same losses and grad norms with the head on the labelled rows and without."""
    from titan_lightning.cli import main
    from titan_lightning.trainer import RUN_DIR_ENV

    folder, data = folder_and_conversations(tmp_path, "llama")
    share, used = causal_lm.LABEL_ROWS_SHARE, []
    prepare = causal_lm.CausalLMModule.prepare_batch_on_host
    monkeypatch.setattr(causal_lm.CausalLMModule, "prepare_batch_on_host",
                        lambda self, batch: used.append("label_rows" in (out := prepare(self, batch))) or out)

    def fit(share: float) -> list[tuple[float, float]]:
        monkeypatch.setattr(causal_lm, "LABEL_ROWS_SHARE", share)
        run_dir = tmp_path / f"run{share}"
        monkeypatch.setenv(RUN_DIR_ENV, str(run_dir))
        assert main(["fit", "--recipe", "recipes.hf:sft", "--job.checkpoint.initial_load_path", str(folder),
                     "--job.data.dataset_path", str(data), "--trainer.accelerator", "cpu", "--trainer.max_steps", "3",
                     "--trainer.max_epochs", "-1", "--trainer.enable_progress_bar", "false",
                     "--job.data.val_fraction", "0", "--trainer.log_every_n_steps", "1",
                     "--job.training.tokens_per_step", "256", "--job.training.tokens_per_microbatch_per_dp_rank", "128"]) == 0
        rows = csv.DictReader(open(next(Path(run_dir).rglob("metrics.csv"))))
        return [(float(r["train/loss"]), float(r["train/grad_norm"])) for r in rows if r.get("train/loss")]

    full = fit(0.0)
    assert used and not any(used)
    used.clear()
    chosen = fit(share)
    assert used and all(used)
    assert len(full) == len(chosen) == 3
    for (loss, norm), (loss_rows, norm_rows) in zip(full, chosen):
        assert loss_rows == pytest.approx(loss, rel=1e-6) and norm_rows == pytest.approx(norm, rel=1e-6)


def test_an_objective_of_ones_own_gets_whole_batches_unless_it_says_it_reads_label_rows():
    """An objective that overrides ``loss`` calls ``token_loss`` with the batch's labels itself (the
    documented way before ``batch_loss``): its batches keep every row, unless it sets ``label_rows``."""
    from titan_lightning.objectives import StepTokenMean

    class OwnLoss(StepTokenMean):
        def loss(self, output, batch):
            return self.token_loss(output, batch["labels"], "sum"), []

    class SaysSo(OwnLoss):
        label_rows = True

    class OnlyEndStep(StepTokenMean):  # (the loss is still StepTokenMean's)
        def end_step(self, grads, device, mesh):
            return super().end_step(grads, device, mesh)

    assert (OwnLoss.label_rows, SaysSo.label_rows, OnlyEndStep.label_rows) == (False, True, True)
    module = _module()
    batch = _batch(module)
    module._objective = OwnLoss(module.token_loss)
    assert "label_rows" not in module.prepare_batch_on_host(batch)
    loss, _ = module.objective.loss(module._batch_input(module.prepare_batch_on_host(batch)), batch)
    assert torch.isfinite(loss)
    module._objective = SaysSo(module.token_loss)
    assert "label_rows" in module.prepare_batch_on_host(batch)
