"""A Hugging Face DeepSeek V3 checkpoint loaded through our adapter gives transformers' logits."""

import pytest
import torch

from titan_lightning.models.common.moe import MoEArgs
from titan_lightning.models.deepseek_v3 import DeepSeekV3Args, Transformer
from titan_lightning.models.deepseek_v3.state_dict_adapter import DeepSeekV3StateDictAdapter, to_hf_config

transformers = pytest.importorskip("transformers", reason="transformers is not a dependency; the GPU machine has it")

# Plain RoPE, and YaRN (positions past original_seq_len: stretched frequencies, mscale).
ROPE = {
    "rope": dict(max_seq_len=64, original_seq_len=64),
    "yarn": dict(max_seq_len=128, original_seq_len=32, rope_factor=4.0, mscale=0.707),
}


def tiny_args(q_lora_rank: int, rope: dict) -> DeepSeekV3Args:
    moe = MoEArgs(num_experts=8, top_k=2, hidden_dim=32, num_shared_experts=1, score_func="sigmoid",
                  route_norm=True, route_scale=2.5)
    return DeepSeekV3Args(
        vocab_size=512, dim=64, n_layers=3, n_dense_layers=1, inter_dim=96, n_heads=4, n_kv_heads=4, norm_eps=1e-6,
        q_lora_rank=q_lora_rank, kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=12,
        moe=moe, **rope,
    )  # fmt: skip


@torch.no_grad()
def randomize(model: torch.nn.Module, seed: int) -> None:
    """Weights far from transformers' init (norms not ones, a routing bias), fp32."""
    g = torch.Generator().manual_seed(seed)
    for name, p in model.named_parameters():
        noise = torch.randn(p.shape, generator=g)
        p.copy_(1.0 + 0.1 * noise if name.endswith("layernorm.weight") or name == "model.norm.weight" else 0.1 * noise)
    for name, b in model.named_buffers():
        if name.endswith("e_score_correction_bias"):
            b.copy_(0.1 * torch.randn(b.shape, generator=g))


@pytest.mark.parametrize("rope", ROPE)
@pytest.mark.parametrize("q_lora_rank", [0, 24])
def test_hf_checkpoint_gives_the_reference_logits(q_lora_rank, rope, tmp_path):
    args = tiny_args(q_lora_rank, ROPE[rope])
    reference = transformers.DeepseekV3ForCausalLM(transformers.DeepseekV3Config(**to_hf_config(args)))
    reference = reference.float().eval()
    randomize(reference, seed=0)
    reference.save_pretrained(tmp_path, safe_serialization=True)

    model = Transformer(args)
    model.init_weights(seed=1)
    DeepSeekV3StateDictAdapter(args).load_into(model, tmp_path)
    model.eval()

    tokens = torch.randint(0, args.vocab_size, (2, 40), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        expected = reference(tokens).logits
        logits = model(tokens)
    assert expected.std() > 0.1  # the logits depend on the weights, not a constant
    torch.testing.assert_close(logits, expected, rtol=0, atol=1e-5)
