"""LoRA adapters over float8 base linears (``job.lora`` with ``quantize.float8``; parallel/float8.py's
``frozen_float8_linear``), in torchao's emulation on CPU: the base matmul is torchao's Float8Linear
matmul without the weight's gradient (bitwise the same output and input gradient, one GEMM fewer in
the backward, only the weight kept for it); every block linear's base computes in float8, adapters
or not; step 1 computes the float8 base model; training follows LoRA in bf16; compiled blocks train
as eager; FSDP, PP and CP over 2 gloo ranks train as one process, and FSDP x EP on Qwen 3 MoE; what
adapters over float8 do not combine with is one line before launch. Speed on a GPU:
benchmarks/throughput.py ``llama3_8b_lora_float8``."""

import pytest
import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

import float8_cases  # (also what the ranks import, through PYTHONPATH)
from test_float8 import HERE, fit, meta_model
from titan_lightning.config import ConfigError, Float8Config, validate_job
from titan_lightning.lora import LoRALinear, lora_layers
from titan_lightning.parallel.float8 import convert_to_float8, float8_base, frozen_float8_linear
from titan_lightning.testing.launch import launch, pythonpath_env

pytest.importorskip("torchao", reason='quantize.float8 needs torchao: pip install -e ".[float8]"')

BLOCK_LINEARS = ("wq", "wk", "wv", "wo", "w1", "w2", "w3")


class CountMatmuls(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.count += func in (torch.ops.aten.mm.default, torch.ops.aten._scaled_mm.default)
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise"])
def test_the_frozen_base_matmul_is_torchaos_float8_matmul_without_the_weight_gradient(recipe):
    from torchao.float8.float8_linear import matmul_with_hp_or_float8_args

    base = float8_base(Float8Config(enable=True, emulate=True, recipe=recipe))
    torch.manual_seed(0)
    weight, grad = torch.randn(64, 32), torch.randn(4, 8, 64)
    x = torch.randn(4, 8, 32, requires_grad=True)
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        ours = frozen_float8_linear(x, weight, base)
    with CountMatmuls() as ours_backward:
        ours.backward(grad)
    ours_grad, x.grad = x.grad, None
    trainable = weight.clone().requires_grad_(True)
    theirs = matmul_with_hp_or_float8_args.apply(x, trainable.t(), base.mm_config, base.config)
    with CountMatmuls() as theirs_backward:
        theirs.backward(grad)
    assert torch.equal(ours, theirs) and torch.equal(ours_grad, x.grad)
    assert torch.equal(ours, x @ weight.t()) is False  # (float8 rounding happened)
    assert (ours_backward.count, theirs_backward.count) == (1, 2)  # no weight gradient
    assert len(saved) == 1 and saved[0].data_ptr() == weight.data_ptr()  # the weight alone, not x


@pytest.mark.parametrize("targets", ["all-linear", "q_proj,v_proj"])
def test_every_block_linear_computes_its_base_in_float8_with_or_without_adapters(targets):
    run = float8_cases.llama3_lora_float8()
    run.job.lora.target_modules = targets.split(",")
    model = meta_model(run)
    converted = convert_to_float8(model, run.job.quantize.float8)
    blocks = [name for name, _ in model.named_modules() if name.rsplit(".", 1)[-1] in BLOCK_LINEARS]
    assert converted == blocks and "output" not in converted
    adapted = {name.rsplit(".", 1)[-1] for name, layer in lora_layers(model)}
    assert adapted == (set(BLOCK_LINEARS) if targets == "all-linear" else {"wq", "wv"})
    assert all(layer.float8 is not None and "float8 base" in repr(layer) for _, layer in lora_layers(model))
    plain = {type(m).__name__ for name, m in model.named_modules() if name in blocks and not hasattr(m, "lora_a")}
    assert plain == (set() if targets == "all-linear" else {"Float8Linear"})
    assert type(model.output) is not nn.Linear or not float8_cases.float8(model.output)


def _bf16(run):
    run.job.training.mixed_precision_param = "bfloat16"
    return run


@pytest.fixture(scope="module")
def lora_float8():
    """8 steps of adapters over float8 bases (bf16 compute), one process."""
    return fit(_bf16(float8_cases.llama3_lora_float8()), 8)


def test_step_one_computes_the_float8_base_and_training_follows_lora_in_bf16(lora_float8):
    lora = _bf16(float8_cases.llama3_lora_float8())
    lora.job.quantize.float8 = Float8Config()
    lora.trainer["callbacks"] = [c for c in lora.trainer["callbacks"] if type(c).__name__ != "ExpectFloat8"]
    # B = 0: the adapters add nothing yet. With adapters on the queries alone, the other linears are
    # torchao's Float8Linear (over the same frozen bf16 weights): the same step-1 loss, bitwise.
    queries_only = _bf16(float8_cases.llama3_lora_float8())
    queries_only.job.lora.target_modules = ["q_proj"]
    assert lora_float8.losses[0] == fit(queries_only, 1).losses[0]
    bf16 = fit(lora, 8).losses
    assert lora_float8.losses[-1] < lora_float8.losses[0] - 0.3  # the adapters train
    assert lora_float8.losses == pytest.approx(bf16, rel=5e-3) and lora_float8.losses != bf16


def test_compiled_blocks_train_adapters_over_float8_as_eager(lora_float8, monkeypatch):
    """The GPU's composition (float8 bases, compiled blocks), traced without inductor, bitwise. (Each
    adapter's A on its own GEMM, as eager: compiled, q / k / v and gate / up compute theirs as one,
    rounded otherwise in bf16; test_lora.py::test_compiled_blocks_compute_the_adapters_of_one_input_in_one_gemm.)"""
    monkeypatch.setattr(LoRALinear, "together", staticmethod(lambda x, linears: tuple(f(x) for f in linears)))
    run = _bf16(float8_cases.llama3_lora_float8())
    run.job.compile.enable, run.job.compile.backend = True, "aot_eager"
    record = fit(run, 8)
    assert record.losses == lora_float8.losses and record.grad_norms == lora_float8.grad_norms


# The one-process runs the layouts reproduce (rowwise scales), run once each.
REFERENCES = {"llama3": lambda: float8_cases.llama3_lora_float8("rowwise"),
              "qwen3_moe": float8_cases.qwen3_moe_lora_float8}
_ONE_PROCESS: dict = {}


@pytest.mark.multi_process
@pytest.mark.parametrize("layout, reference", [
    ("llama3_fsdp2_lora_float8", "llama3"), ("llama3_pp2_lora_float8", "llama3"), ("llama3_cp2_lora_float8", "llama3"),
    ("qwen3_moe_fsdp2_ep2_lora_float8", "qwen3_moe")])
def test_2_gloo_ranks_train_adapters_over_float8_as_one_process(layout, reference, tmp_path):
    """Rowwise scales: a rank casts each of its tokens as one process does (tensorwise scales of
    part of a batch round the adapters' small gradients ~2% apart, by design). On the MoE the routed
    experts and their adapters (bf16) are sharded over EP x FSDP, and the routed tokens' gradients
    come back summed in another order (grad norms within 1e-4)."""
    if reference not in _ONE_PROCESS:
        _ONE_PROCESS[reference] = fit(REFERENCES[reference](), 4)
    one = _ONE_PROCESS[reference]
    argv = ["fit", "--trainer.accelerator", "cpu", "--trainer.devices", "2", "--recipe", f"float8_cases:{layout}",
            "--trainer.max_steps", "4"]
    for rank in launch(argv, 2, out_dir=tmp_path, timeout=300, env=pythonpath_env(HERE)).ranks:
        assert rank["losses"] == pytest.approx(one.losses, rel=1e-6)
        assert rank["grad_norms"] == pytest.approx(one.grad_norms, rel=1e-4 if reference == "qwen3_moe" else 1e-5)


@pytest.mark.parametrize("change,message", [
    ({"tp": 2}, "quantize.float8.enable=True with lora.rank=4 and parallelism.tp=2: adapters over float8 base "
                "linears are built for one process, FSDP2 / HSDP, CP, PP and EP, not tensor parallelism; set "
                "parallelism.tp=1 or quantize.float8.enable=False"),
    ({"quantize_base": "nf4"}, "lora.quantize_base='nf4' with quantize.float8.enable=True: an NF4 base has no "
                               "float8 matmul; set lora.quantize_base=None or quantize.float8.enable=False"),
    ({"all_gather": True}, "quantize.float8.enable_fsdp_float8_all_gather=True with lora.rank=4: a LoRA run's frozen "
                           "base is all-gathered in its own dtype and cast to float8 at each matmul; set "
                           "quantize.float8.enable_fsdp_float8_all_gather=False"),
])
def test_what_adapters_over_float8_do_not_combine_with_is_one_line(change, message):
    job = float8_cases.llama3_lora_float8().job
    job.parallelism.tp = change.get("tp", 1)
    job.lora.quantize_base = change.get("quantize_base")
    job.quantize.float8.enable_fsdp_float8_all_gather = change.get("all_gather", False)
    with pytest.raises(ConfigError) as raised:
        validate_job(job, world_size=job.parallelism.tp)
    assert str(raised.value) == message
