"""Per-expert token counts with and without auxiliary-loss-free load balancing.

    python benchmarks/moe_balance.py --steps 20

Trains recipes.qwen3:debugmodel_moe (64 experts, top-8, one process, CPU) for --steps
steps, once with the load-balancing bias (moe.load_balance_coeff, the preset's 1e-3) and
once without (None), and prints, for the last step, the histogram of tokens per expert over
all MoE layers: min / median / max per expert, the coefficient of variation and the share of
the busiest expert (perfect balance: every expert gets tokens * top_k / 64).
"""

import argparse
import statistics
import tempfile

import lightning as L
import torch


class _LastStepCounts(L.Callback):
    """Per-layer tokens per expert of the last optimizer step (the counts accumulate from the
    last bias update, or from the start when nothing resets them: only the step's increment)."""

    def __init__(self) -> None:
        self.counts = None
        self._baseline = None

    @staticmethod
    def _now(pl_module) -> torch.Tensor:
        from titan_lightning.models.common.moe import moe_modules

        return torch.stack([m.tokens_per_expert.clone() for m in moe_modules(pl_module.model)])

    def on_before_optimizer_step(self, trainer, pl_module, optimizer) -> None:
        now = self._now(pl_module)
        self.counts = now if self._baseline is None else now - self._baseline

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        self._baseline = self._now(pl_module)  # zero after a bias update, else the running total


def run(steps: int, coeff) -> torch.Tensor:
    import recipes.qwen3 as qwen3
    from titan_lightning.trainer import RUN_DIR_ENV, build_trainer
    import os

    run = qwen3.debugmodel_moe()
    run.job.model.moe.load_balance_coeff = coeff
    record = _LastStepCounts()
    run.trainer.update(max_steps=steps, callbacks=[record], accelerator="cpu", devices=1, logger=False,
                       enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                       limit_val_batches=0, num_sanity_val_steps=0)
    with tempfile.TemporaryDirectory() as folder:
        os.environ[RUN_DIR_ENV] = folder
        build_trainer(run).fit(run.module, datamodule=run.datamodule)
    return record.counts


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=20)
    args = parser.parse_args()
    print(f"qwen3 debugmodel_moe, 64 experts, top-8, 8 MoE layers, 2,048 tokens/step; step {args.steps}:")
    print("| load balancing | tokens/expert min | median | max | coeff. of variation | busiest expert's share |")
    print("|---|---|---|---|---|---|")
    for name, coeff in (("bias, coeff 1e-3", 1e-3), ("none", None)):
        counts = run(args.steps, coeff)  # [layers, experts]
        flat = counts.flatten().tolist()
        per_layer_cv = (counts.std(dim=1) / counts.mean(dim=1)).mean().item()
        share = (counts.max(dim=1).values / counts.sum(dim=1)).mean().item()
        print(f"| {name} | {min(flat):.0f} | {statistics.median(flat):.0f} | {max(flat):.0f} | "
              f"{per_layer_cv:.3f} | {share:.3%} (balanced: {1 / counts.shape[1]:.3%}) |")
        print("  per-layer histogram (sorted counts):", [sorted(int(c) for c in row) for row in counts[:2].tolist()])


if __name__ == "__main__":
    main()
