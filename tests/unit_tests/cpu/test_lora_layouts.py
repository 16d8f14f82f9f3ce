"""LoRA at every layout (titan_lightning/lora/parallel.py): the routed experts' adapters (PEFT's
``target_parameters``), the tensor-parallel styles of a linear with adapters, and the layouts refused
before launch. That each layout equals one process is the suites' (features: llama3_lora_*, models:
qwen3_moe_lora_fsdp2_ep2)."""

import shutil

import pytest
import torch
import torch.distributed as dist
from torch import nn

from titan_lightning.config import ConfigError
from titan_lightning.config.lora import LoRAConfig
from titan_lightning.lora import adapters_off, base_only, expert_adapters
from titan_lightning.lora.experts import expert_updates, split_gate_up

from tests.hf_folders import VOCAB, save_hf_model


def _experts_ours(folder, lora: LoRAConfig):
    from test_lora import _ours

    return _ours(folder, lora)


def test_expert_adapters_step_one_loss_and_gradients_equal_peft_target_parameters(tmp_path):
    """Qwen3-MoE with adapters on the attention and both expert tensors against PEFT's ParamWrapper
    on transformers' fused experts: the same loss and the same gradients of every factor."""
    peft = pytest.importorskip("peft", reason="PEFT is the reference for LoRA (setup.cfg's dev extra)")
    folder = tmp_path / "hf"
    theirs = save_hf_model(folder, "qwen3_moe").train()
    lora = LoRAConfig(rank=4, alpha=8.0, target_modules="q_proj,v_proj", target_parameters="gate_up_proj,down_proj")
    ours, adapter = _experts_ours(folder, lora)
    theirs = peft.get_peft_model(theirs, peft.LoraConfig(r=4, lora_alpha=8.0, target_modules=["q_proj", "v_proj"],
                                                         target_parameters=["mlp.experts.gate_up_proj",
                                                                            "mlp.experts.down_proj"]))
    adapted = expert_adapters(ours)
    assert adapted and all(set(experts.lora_a) == {"gate_up_proj", "down_proj"} for _, experts in adapted)

    def wrapper(layer: int, name: str):  # PEFT nests its wrappers: the first target innermost
        outer = theirs.base_model.model.model.layers[layer].mlp.experts
        return outer.base_layer if name == "gate_up_proj" else outer

    def peft_a(a: torch.Tensor) -> torch.Tensor:  # ours [E, r, in] -> PEFT's [E * r, in]
        return a.reshape(-1, a.shape[-1])

    def peft_b(b: torch.Tensor) -> torch.Tensor:  # ours [E, out, r] -> PEFT's [out, r * E]
        return b.permute(1, 2, 0).reshape(b.shape[1], -1)

    g = torch.Generator().manual_seed(0)
    with torch.no_grad():  # B off zero: every factor changes the output and gets a gradient
        for _, layer in _linears(ours):
            layer.lora_b.weight.copy_(0.1 * torch.randn(layer.lora_b.weight.shape, generator=g))
        for index, (_, experts) in enumerate(adapted):
            for name in experts.lora_a:
                experts.lora_b[name].copy_(0.1 * torch.randn(experts.lora_b[name].shape, generator=g))
                w = wrapper(index, name)
                w.lora_A["default"].weight.copy_(peft_a(experts.lora_a[name]))
                w.lora_B["default"].weight.copy_(peft_b(experts.lora_b[name]))
        names = _hf_names(ours, adapter)
        for name, layer in _linears(ours):
            their = theirs.base_model.model.get_submodule(names[name])
            their.lora_A["default"].weight.copy_(layer.lora_a.weight)
            their.lora_B["default"].weight.copy_(adapter.to_hf({f"{name}.weight": layer.lora_b.weight})[
                f"{names[name]}.weight"])
    tokens = torch.randint(0, VOCAB, (2, 16), generator=g)
    loss = _cross_entropy(ours(tokens), tokens)
    loss.backward()
    their_loss = _cross_entropy(theirs(input_ids=tokens).logits, tokens)
    their_loss.backward()
    torch.testing.assert_close(loss, their_loss, rtol=0, atol=1e-6)
    for index, (_, experts) in enumerate(adapted):
        for name in experts.lora_a:
            w = wrapper(index, name)
            assert experts.lora_b[name].grad.abs().sum() > 0
            torch.testing.assert_close(peft_a(experts.lora_a[name].grad), w.lora_A["default"].weight.grad,
                                       rtol=1e-5, atol=1e-6)
            torch.testing.assert_close(peft_b(experts.lora_b[name].grad), w.lora_B["default"].weight.grad,
                                       rtol=1e-5, atol=1e-6)
    assert all(p.grad is None for p in ours.parameters() if not p.requires_grad)

    # The exports: PEFT's folder (the experts' factors as its ParamWrapper saves them) loads on the base
    # folder with our logits, and so does the merged folder (every expert's W + alpha / r * B A).
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM

    from titan_lightning.lora.export import MergedState, peft_state, write_peft_folder

    write_peft_folder(tmp_path / "adapter", peft_state(ours, adapter), lora, str(folder))
    loaded = peft.PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32),
                                            tmp_path / "adapter").eval()
    merged_folder = tmp_path / "merged"
    merged_folder.mkdir()
    shutil.copy(folder / "config.json", merged_folder)
    save_file({k: v.contiguous() for k, v in adapter.to_hf(dict(MergedState(ours))).items()},
              str(merged_folder / "model.safetensors"), metadata={"format": "pt"})
    merged = AutoModelForCausalLM.from_pretrained(merged_folder, dtype=torch.float32).eval()
    with torch.no_grad():
        logits = ours(tokens)
        torch.testing.assert_close(loaded(input_ids=tokens).logits, logits, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(merged(input_ids=tokens).logits, logits, rtol=1e-5, atol=1e-5)
        for _, experts in adapted:  # (the experts' adapters alone off: they count)
            experts.adapters_on = False
        assert (ours(tokens) - logits).abs().max() > 1e-3


def _linears(model):
    from titan_lightning.lora import lora_layers

    return list(lora_layers(model))


def _hf_names(model, adapter):
    from titan_lightning.lora.targets import hf_linears

    return hf_linears(model, adapter)


def _cross_entropy(logits: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    return nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1), tokens[:, 1:].flatten())
