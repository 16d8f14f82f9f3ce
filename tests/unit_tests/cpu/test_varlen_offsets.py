"""varlen attention's document offsets come from the batch's host copy (CausalLMModule.
prepare_batch_on_host, which TextDataModule.on_before_batch_transfer calls), so that the forward does
not wait for the device to read them: the same cu_seqlens and longest document the device path
computes, handed to the model's Documents; batches that must not carry them (other kernels and
masks, pipeline parallelism) are left alone. The kernel itself is CUDA-only:
tests/unit_tests/gpu/test_varlen_host_offsets_gpu.py runs a step both ways."""

from types import SimpleNamespace

import dataclasses

import pytest
import torch

from recipes.llama3 import debugmodel
from titan_lightning.models.common.masking import documents_for

# Row 0: documents of 5, 1, 9 and 17 tokens; row 1: one document filling the window.
POSITIONS = torch.tensor([list(range(5)) + [0] + list(range(9)) + list(range(17)), list(range(32))])


def _module(**model):
    run = debugmodel()
    job = run.job
    job = dataclasses.replace(job, model=dataclasses.replace(job.model, **model))
    run.set_job(job)
    return run.module


def test_a_varlen_batch_gets_the_offsets_the_device_would_compute():
    module = _module(attention="varlen", mask="block_causal", positions="per_document")
    batch = {"input_ids": torch.zeros_like(POSITIONS), "labels": torch.zeros_like(POSITIONS), "position_ids": POSITIONS}
    out = module.prepare_batch_on_host(batch)
    assert out["cu_seqlens"].tolist() == [0, 5, 6, 15, 32, 64]
    assert out["cu_seqlens"].dtype == torch.int32 and out["max_seqlen"] == 32
    assert set(batch) == {"input_ids", "labels", "position_ids"}  # the loader's batch is not changed
    on_device = documents_for(module.job.model, POSITIONS, batch["input_ids"])
    given = documents_for(module.job.model, POSITIONS, batch["input_ids"], offsets=(out["cu_seqlens"], out["max_seqlen"]))
    assert torch.equal(given.cu_seqlens, on_device.cu_seqlens) and given.max_len == on_device.max_len


def test_the_data_module_hands_batches_to_the_module_before_the_transfer():
    """Lightning calls the data module's hook (the module defines none: Lightning would warn on every
    run that passes a data module); it hands the batch to the module's host-side preparation."""
    run = debugmodel()
    run.set_job(dataclasses.replace(run.job, model=dataclasses.replace(
        run.job.model, attention="varlen", mask="block_causal", positions="per_document")))
    run.datamodule.trainer = SimpleNamespace(lightning_module=run.module)
    batch = {"input_ids": torch.zeros_like(POSITIONS), "position_ids": POSITIONS}
    assert run.datamodule.on_before_batch_transfer(batch, 0)["max_seqlen"] == 32
    assert "on_before_batch_transfer" not in vars(type(run.module))


@pytest.mark.parametrize("model, pp", [
    (dict(attention="sdpa", mask="block_causal", positions="per_document"), 1),
    (dict(attention="varlen", mask="causal"), 1),  # one document per row: no host read to save
    (dict(attention="varlen", mask="block_causal", positions="per_document"), 2),  # the schedule splits batches
])
def test_other_batches_are_left_alone(model, pp):
    module = _module(**model)
    if pp > 1:
        module.job = dataclasses.replace(module.job, parallelism=dataclasses.replace(module.job.parallelism, pp=pp))
    batch = {"input_ids": torch.zeros_like(POSITIONS), "position_ids": POSITIONS}
    assert module.prepare_batch_on_host(batch) is batch


def test_the_varlen_signature_check_traces_quietly_in_a_compiled_block():
    """The kernel's ``enable_gqa`` support is read at import: a cache around the check (``lru_cache``)
    made Dynamo warn in every compiled GQA block of a varlen run on torch 2.13."""
    import warnings

    from titan_lightning.models.common import masking

    def block(x):
        return x * 2 if masking._varlen_takes_enable_gqa() else x

    torch._dynamo.reset()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out = torch.compile(block, backend="eager", fullgraph=True)(torch.ones(2))
    assert [str(w.message) for w in caught if "lru_cache" in str(w.message)] == []
    assert torch.equal(out, block(torch.ones(2)))
