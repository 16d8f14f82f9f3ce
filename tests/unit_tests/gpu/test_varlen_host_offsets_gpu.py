"""varlen attention with the document offsets computed on the host (CausalLMModule.
prepare_batch_on_host) trains as with the offsets computed on the device, for a grouped-query
model in bf16 autocast (the kernel serves GQA itself): the same loss bitwise (the forward is
deterministic), and gradients that differ from the device path's by no more than two runs of the
device path differ from each other (FlashAttention's backward may accumulate in another order)."""

import dataclasses

import pytest
import torch

from recipes.llama3 import debugmodel

pytestmark = pytest.mark.gpu


def test_host_offsets_train_as_device_offsets():
    run = debugmodel()
    job = run.job
    model = dataclasses.replace(job.model, attention="varlen", mask="block_causal", positions="per_document",
                                n_heads=8, n_kv_heads=2)
    run.set_job(dataclasses.replace(job, model=model, training=dataclasses.replace(
        job.training, mixed_precision_param="bfloat16")))
    module = run.module
    module.configure_model()
    module.model.to_empty(device="cuda")
    module.model.init_weights(seed=0)
    g = torch.Generator().manual_seed(0)
    lengths = [[37, 1, 90, 128], [256]]
    positions = torch.stack([torch.cat([torch.arange(n) for n in row]) for row in lengths])
    ids = torch.randint(0, model.vocab_size, positions.shape, generator=g)
    batch = {"input_ids": ids, "labels": ids.roll(-1, 1), "position_ids": positions}

    def step(batch):
        module.zero_grad(set_to_none=True)
        loss = module.loss_fn(module._batch_input(batch), batch["labels"])
        loss.backward()
        return [loss.detach()] + [p.grad.clone() for p in module.parameters()]

    device = lambda b: {k: v.cuda() if isinstance(v, torch.Tensor) else v for k, v in b.items()}  # noqa: E731
    host = module.prepare_batch_on_host(batch)
    assert "cu_seqlens" in host
    reference, again, ours = step(device(batch)), step(device(batch)), step(device(host))
    assert torch.equal(ours[0], reference[0])
    for a, b, c in zip(reference[1:], again[1:], ours[1:]):
        noise = (a - b).abs().max()
        assert (c - a).abs().max() <= max(2 * noise, 1e-6 * a.abs().max())
