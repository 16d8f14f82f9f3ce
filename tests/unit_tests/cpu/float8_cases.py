"""Float8 recipes for test_float8.py and test_lora_float8.py (imported by the tests and, through
PYTHONPATH, by their ranks): the small Llama 3 in torchao's emulation, on one process, FSDP over 2 or
TP over 2, with a callback that fails the rank unless the linears it trains are float8 (and the head
is not); with LoRA adapters over float8 base linears on one process, FSDP over 2, PP over 2, CP
over 2, and on Qwen 3 MoE FSDP x EP over 2."""

import lightning as L
from torch import nn

from recipes.tests import features
from titan_lightning.recipe import Run, on_layout, with_cp


class ExpectFloat8(L.Callback):
    """Fails the run unless every block linear is torchao's Float8Linear and the head a plain one."""

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        model = pl_module.model
        kinds = {float8(module) for name, module in model.named_modules()
                 if name.rsplit(".", 1)[-1] in ("wq", "wk", "wv", "wo", "w1", "w2", "w3")}
        head = getattr(model, "output", None)  # (None: a pipeline stage before the last)
        if kinds != {True} or (head is not None and (float8(head) or not isinstance(head, nn.Linear))):
            raise AssertionError(f"block linears float8: {sorted(kinds)}, the head: {type(head).__name__}")


def float8(module: nn.Module) -> bool:
    """torchao's Float8Linear (or FSDP's subclass of it, once sharded), or an adapted linear whose
    base computes in float8."""
    return any(cls.__name__ == "Float8Linear" for cls in type(module).__mro__) or (
        getattr(module, "float8", None) is not None)


def llama3_small_float8(recipe: str = "tensorwise") -> Run:
    run = features.llama3_small()
    f8 = run.job.quantize.float8
    f8.enable, f8.emulate, f8.recipe = True, True, recipe
    run.trainer["callbacks"] = [*run.trainer.get("callbacks", []), ExpectFloat8()]
    return run


def llama3_fsdp2_float8() -> Run:
    """FSDP over 2 ranks, the same global batch as one process."""
    return on_layout(llama3_small_float8(), dp_shard=2)


def llama3_tp2_float8() -> Run:
    """TP over 2 ranks without sequence parallelism (gloo cannot all-gather the float8 block inputs)."""
    return on_layout(llama3_small_float8(), dp_shard=1, tp=2, sequence_parallel=False)


def llama3_lora_float8(recipe: str = "tensorwise") -> Run:
    """Adapters (rank 4, every block linear) over float8 base linears."""
    run = llama3_small_float8(recipe)
    run.job.lora.rank, run.job.lora.alpha = 4, 8.0
    run.job.optimizer.lr = 3e-2  # (adapters from B = 0 move the loss slowly at the full model's rate)
    return run


# Layouts of adapters over float8 bases with rowwise scales (per token and per output row: what a
# rank casts does not depend on the rest of the batch), each the same global batch as one process.
def llama3_fsdp2_lora_float8() -> Run:
    return on_layout(llama3_lora_float8("rowwise"), dp_shard=2)


def llama3_pp2_lora_float8() -> Run:
    """1F1B over 2 microbatches, one of the two layers on each stage."""
    return on_layout(llama3_lora_float8("rowwise"), dp_shard=1, pp=2, pp_schedule="1F1B", pp_microbatches=2)


def llama3_cp2_lora_float8() -> Run:
    return with_cp(llama3_lora_float8("rowwise"), "allgather", cp=2, dp_shard=1)


def qwen3_moe_lora_float8() -> Run:
    """The MoE LoRA seed (adapters on attention and on the routed experts) with float8 bases: attention
    computes in float8, the routed experts and their adapters stay bf16 (one process)."""
    from recipes.tests.models import qwen3_moe_lora

    run = qwen3_moe_lora()
    f8 = run.job.quantize.float8
    f8.enable, f8.emulate, f8.recipe = True, True, "rowwise"
    return run


def qwen3_moe_fsdp2_ep2_lora_float8() -> Run:
    return on_layout(qwen3_moe_lora_float8(), dp_shard=2, ep=2)
