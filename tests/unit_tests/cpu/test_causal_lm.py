"""The shared LightningModule: loss, determinism, clipping, precision, safety checks."""

import math

import lightning as L
import pytest
import torch

from recipes.tests import features
from titan_lightning.config import ConfigError
from titan_lightning.models.causal_lm import IGNORE_INDEX, cross_entropy_loss
from titan_lightning.testing.record import RecordSteps
from titan_lightning.trainer import RUN_DIR_ENV, build_trainer


@pytest.fixture(autouse=True)
def run_folder(tmp_path, monkeypatch):
    monkeypatch.setenv(RUN_DIR_ENV, str(tmp_path / "run"))


def fit(run, max_steps=3):
    record = RecordSteps()
    run.trainer.update(max_steps=max_steps, callbacks=[record], accelerator="cpu", devices=1)
    trainer = build_trainer(run)
    trainer.fit(run.module, datamodule=run.datamodule)
    return record, trainer


def test_loss_is_mean_over_tokens_whose_label_is_not_ignored():
    logits = torch.randn(2, 5, 11)
    labels = torch.randint(0, 11, (2, 5))
    labels[0, :3] = IGNORE_INDEX
    keep = labels != IGNORE_INDEX
    by_hand = -torch.log_softmax(logits, -1)[keep].gather(1, labels[keep][:, None]).mean()
    assert torch.allclose(cross_entropy_loss(logits, labels), by_hand)


def test_reruns_are_bitwise_identical_and_seed_matters():
    first, _ = fit(features.llama3_small())
    second, _ = fit(features.llama3_small())
    assert first.losses == second.losses
    assert first.grad_norms == second.grad_norms
    other = features.llama3_small()
    other.job.training.seed = 1
    third, _ = fit(other)
    assert third.losses != first.losses
    assert first.losses[0] == pytest.approx(math.log(2048), abs=1.0)


class GradsAtStep(L.Callback):
    """The gradient norm the optimizer steps with, and whether any gradient survives into the
    next step's forward."""

    def __init__(self) -> None:
        self.step_norms, self.grads_at_batch_start = [], []

    def on_train_start(self, trainer, pl_module) -> None:
        def after_step(optimizer, args, kwargs):  # the closure (forward, backward, clipping) runs inside step()
            grads = [p.grad for group in optimizer.param_groups for p in group["params"] if p.grad is not None]
            self.step_norms.append(torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g) for g in grads])).item())

        trainer.optimizers[0].register_step_post_hook(after_step)

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        self.grads_at_batch_start.append(sum(p.grad is not None for p in pl_module.parameters()))


def test_grad_norm_is_logged_before_clipping_and_grads_are_clipped():
    run = features.llama3_debugmodel()
    run.job.training.max_grad_norm = 1e-3
    seen = GradsAtStep()
    run.trainer["callbacks"] = [seen]
    record = RecordSteps()
    run.trainer.update(max_steps=2, accelerator="cpu", devices=1)
    run.trainer["callbacks"].append(record)
    build_trainer(run).fit(run.module, datamodule=run.datamodule)
    assert record.grad_norms[0] > 1e-3  # the pre-clip norm is what is logged
    assert seen.step_norms == pytest.approx([1e-3, 1e-3], rel=1e-3)  # the optimizer steps with the clipped ones


def test_gradients_are_freed_after_the_optimizer_step():
    """Not kept through the next forward (Lightning alone zeroes them after it)."""
    seen = GradsAtStep()
    run = features.llama3_debugmodel_accumulation()  # 2 microbatches per step
    run.trainer.update(max_steps=2, accelerator="cpu", devices=1, callbacks=[seen])
    build_trainer(run).fit(run.module, datamodule=run.datamodule)
    assert seen.grads_at_batch_start[0] == 0
    assert seen.grads_at_batch_start[1] > 0  # accumulating: the first microbatch's gradients are kept
    assert seen.grads_at_batch_start[2:] == [0, seen.grads_at_batch_start[1]]
    assert all(p.grad is None for p in run.module.parameters())


def test_gradient_accumulation_comes_from_tokens_per_step():
    record, trainer = fit(features.llama3_debugmodel_accumulation(), max_steps=2)
    assert trainer.accumulate_grad_batches == 2
    assert trainer.global_step == 2
    assert len(record.losses) == 2


def test_bf16_compute_with_fp32_params_trains():
    run = features.llama3_debugmodel_bf16()
    record, _ = fit(run, max_steps=2)
    assert all(math.isfinite(x) for x in record.losses)
    assert all(p.dtype == torch.float32 for p in run.module.model.parameters())


def test_full_bf16_parameters():
    run = features.llama3_small()  # bf16 matmuls are slow on CPUs without native bf16
    run.job.training.dtype = "bfloat16"
    run.job.training.mixed_precision_param = "bfloat16"
    record, _ = fit(run, max_steps=1)
    assert all(p.dtype == torch.bfloat16 for p in run.module.model.parameters())
    assert run.module.model.rope_cache.dtype == torch.float32
    assert math.isfinite(record.losses[0])


class Poison(L.Callback):
    """NaN head weights at the start of step ``step`` (1-based); counts the steps started."""

    def __init__(self, step: int) -> None:
        self.step, self.started = step, 0

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        self.started += 1
        if trainer.global_step + 1 == self.step:
            with torch.no_grad():
                pl_module.model.output.weight.fill_(float("nan"))


def fit_poisoned(step: int, max_steps: int, **job_checkpoint):
    run = features.llama3_small()
    for name, value in job_checkpoint.items():
        setattr(run.job.checkpoint, name, value)
    poison = Poison(step)
    run.trainer.update(max_steps=max_steps, callbacks=[poison], accelerator="cpu", devices=1,
                       enable_checkpointing=bool(job_checkpoint))
    trainer = build_trainer(run)
    with pytest.raises(FloatingPointError) as error:
        trainer.fit(run.module, datamodule=run.datamodule)
    return str(error.value), poison, trainer


def test_non_finite_loss_stops_the_run_one_step_later():
    """Read without a host sync, step 2's NaN is seen at step 3's clipping: step 2's optimizer step
    ran, step 3's did not, and step 4 never started."""
    message, poison, trainer = fit_poisoned(step=2, max_steps=5)
    assert message == "non-finite training loss nan at step 2; stopping before step 3's optimizer step"
    assert poison.started == 3
    assert trainer.global_step == 2


def test_a_non_finite_last_step_is_caught_at_the_end_of_training():
    message, _, trainer = fit_poisoned(step=2, max_steps=2)
    assert message == "non-finite training loss nan at step 2; stopping at the end of training"
    assert trainer.global_step == 2


def test_no_checkpoint_is_saved_after_a_non_finite_step(tmp_path):
    message, _, trainer = fit_poisoned(step=2, max_steps=5, interval=1)
    assert message == "non-finite training loss nan at step 2; stopping before saving a checkpoint"
    assert sorted(p.name for p in (tmp_path / "run" / "checkpoints").iterdir()) == ["epoch=0-step=1.ckpt"]


def test_clipping_scales_by_the_device_side_coefficient_exactly_as_the_host_did():
    from titan_lightning.parallel.grad_norm import clip_grads_, global_grad_norm

    g = torch.Generator().manual_seed(0)
    grads = [torch.randn(7, 5, generator=g) * 3, torch.randn(11, generator=g)]
    norm = global_grad_norm(grads)
    host = min(1.0 / (norm.item() + 1e-6), 1.0)  # the previous implementation's Python float
    expected = [t * host for t in grads]
    clip_grads_(grads, 1.0, norm)
    assert all(torch.equal(a, b) for a, b in zip(grads, expected))
    unclipped = [t.clone() for t in grads]
    clip_grads_(grads, 100.0, global_grad_norm(grads))  # a factor of exactly 1.0
    assert all(torch.equal(a, b) for a, b in zip(grads, unclipped))


def test_trainer_arguments_owned_by_the_job_are_refused():
    run = features.llama3_debugmodel()
    run.trainer["gradient_clip_val"] = 1.0
    with pytest.raises(ConfigError, match=r"trainer.gradient_clip_val=1.0 is set by job.training.max_grad_norm"):
        build_trainer(run)


def test_tokenizer_larger_than_model_vocab_is_refused():
    run = features.llama3_debugmodel()
    run.job.model.vocab_size = 1024
    with pytest.raises(ConfigError, match=r"tokenizer has 2048 tokens, more than model.vocab_size=1024"):
        build_trainer(run)


# -- FLOPs and MFU ---------------------------------------------------------------------------


def test_flops_per_token_is_six_n_plus_attention_by_hand():
    from recipes import deepseek_v3, llama3, qwen3

    # Llama 3 8B: 8,030,261,248 parameters, 128,256 x 4,096 embedding; 32 layers x 32 heads x 128.
    m = llama3.llama3_8b().module
    n = 8_030_261_248 - 128_256 * 4096
    assert m.flops_per_token(8192) == 6 * n + 12 * 32 * 32 * 128 * 8192
    # Sliding layers count their window of keys: half the layers at 1024 of 8192.
    m.job.model.sliding_window, m.job.model.layer_types = 1024, ["sliding_attention", "full_attention"] * 16
    assert m.flops_per_token(8192) == 6 * n + 12 * 32 * 32 * 128 * (8192 + 1024) / 2
    assert m.flops_per_token(512) == 6 * n + 12 * 32 * 32 * 128 * 512  # a window past the sequence: all of it
    # Qwen 3 MoE debug model: top_k of the experts count, not all of them.
    moe = qwen3.debugmodel_moe().module
    a = moe.job.model
    active = moe._flop_terms()[0]
    dense_ffn_all = 3 * a.dim * a.moe.hidden_dim * a.moe.num_experts
    dense_ffn_top = 3 * a.dim * a.moe.hidden_dim * a.moe.top_k
    from titan_lightning.models.qwen3.model import Transformer

    assert Transformer.count_parameters(a) - a.vocab_size * a.dim - active == a.n_layers * (dense_ffn_all - dense_ffn_top)
    # DeepSeek V3: MLA heads have query-key dim nope + rope and value dim v.
    ds = deepseek_v3.debugmodel().module
    d = ds.job.model
    assert ds._flop_terms()[1] == d.n_layers * d.n_heads * (d.qk_nope_head_dim + d.qk_rope_head_dim + d.v_head_dim)


def test_lora_counts_four_flops_per_frozen_weight_and_six_per_adapter_weight():
    """No weight gradient for a frozen base: its forward and the activations' gradient; the adapters
    (r x (in + out) on each of the 7 linears of a block) take all three matmuls."""
    from recipes import llama3
    from titan_lightning.config.lora import LoRAConfig

    full = llama3.llama3_8b().module
    run = llama3.llama3_8b()
    run.job.lora = LoRAConfig(rank=16, alpha=32.0)
    lora = run.module  # (its model not built yet: as a benchmark's contender row counts it)
    n = 8_030_261_248 - 128_256 * 4096
    block = 16 * ((4096 + 4096) * 2 + (4096 + 1024) * 2 + (4096 + 14336) * 2 + (14336 + 4096))
    attention = 12 * 32 * 32 * 128 * 8192
    assert full.flops_per_token(8192) == 6 * n + attention
    assert lora.flops_per_token(8192) == 4 * n + 6 * 32 * block + attention
    with torch.device("meta"):
        lora.model = lora.build_model()  # (built, as in a run: the same count)
    assert lora.flops_per_token(8192) == 4 * n + 6 * 32 * block + attention


def test_mfu_and_peak_lookup():
    from titan_lightning.callbacks.metrics import PEAK_FLOPS, mfu, peak_flops

    assert peak_flops("NVIDIA H200") == peak_flops("NVIDIA H100 80GB HBM3") == 989e12
    assert peak_flops("NVIDIA A100-SXM4-80GB") == 312e12 and peak_flops("cpu") is None
    assert peak_flops("My Accelerator", {"My": 1e15}) == 1e15 and "H200" in PEAK_FLOPS
    # 10,000 tokens/s x 5.79e10 FLOPs / 989e12 = 58.5%
    assert abs(mfu(10_000, 5.79e10, 989e12) - 100 * 10_000 * 5.79e10 / 989e12) < 1e-12
    assert round(mfu(10_000, 5.79e10, 989e12), 1) == 58.5


def test_the_progress_bar_shows_the_previous_steps_values_from_the_host():
    """Lightning turns every progress-bar value into a Python number after each step, which on a
    GPU waits for all the work queued so far. So the bar's ``loss`` and ``grad_norm`` are the
    previous step's, from the finiteness check's host copies (CPU tensors), and ``train/loss`` /
    ``train/grad_norm`` (each step's own; the loss averaged over ranks) go to loggers and callbacks
    only."""
    shown = []

    class Bar(L.Callback):
        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            results = trainer._results  # what this step logged, with how (prog_bar or not)
            bar = {m.meta.name: m._forward_cache for _, m in results.valid_items() if m.meta.prog_bar}
            assert all(t.device.type == "cpu" and t.grad_fn is None for t in bar.values())
            assert not any(m.meta.prog_bar for _, m in results.valid_items() if m.meta.name.startswith("train/loss"))
            shown.append({name: t.item() for name, t in bar.items() if name in ("loss", "grad_norm")})

    run = features.llama3_debugmodel()
    record = RecordSteps()
    run.trainer.update(max_steps=4, accelerator="cpu", devices=1, callbacks=[record, Bar()])
    build_trainer(run).fit(run.module, datamodule=run.datamodule)
    assert shown[0] == {}  # nothing checked yet at the first step
    for step in range(1, 4):
        assert shown[step]["loss"] == pytest.approx(record.losses[step - 1], rel=1e-6)
        assert shown[step]["grad_norm"] == pytest.approx(record.grad_norms[step - 1], rel=1e-6)


def test_the_decoder_default_parameter_count_agrees_with_each_family_arithmetic():
    # Decoder.count_parameters (meta-device count) is what a family without its own arithmetic gets.
    from titan_lightning.models.common.decoder import Decoder
    from titan_lightning.models.common.moe import MoEArgs
    from titan_lightning.models.deepseek_v3 import deepseek_v3_args
    from titan_lightning.models.deepseek_v3.model import Transformer as DeepSeekV3
    from titan_lightning.models.llama3 import llama3_args
    from titan_lightning.models.llama3.model import Transformer as Llama3
    from titan_lightning.models.qwen3 import Qwen3Args
    from titan_lightning.models.qwen3.model import Transformer as Qwen3

    default = Decoder.count_parameters.__func__
    qwen3 = dict(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=32, ffn_hidden_dim=96, vocab_size=128)
    moe = MoEArgs(num_experts=8, top_k=2, hidden_dim=32, num_shared_experts=1)
    for family, args in ((Llama3, llama3_args("debugmodel")), (Qwen3, Qwen3Args(**qwen3)),
                         (Qwen3, Qwen3Args(**qwen3, moe=moe))):
        for active in (False, True):
            assert default(family, args, active=active) == family.count_parameters(args, active=active)
    ds = deepseek_v3_args("debugmodel")  # (its active count also leaves out the embedding table)
    assert default(DeepSeekV3, ds) == DeepSeekV3.count_parameters(ds)
    assert default(DeepSeekV3, ds, active=True) - ds.vocab_size * ds.dim == DeepSeekV3.count_parameters(ds, active=True)
