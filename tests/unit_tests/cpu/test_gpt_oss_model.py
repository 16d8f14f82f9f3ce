"""gpt-oss's MoE parts in models/common/moe.py: experts with biases and the clamped SwiGLU give
the same values and gradients on the grouped GEMM (torch's CPU kernel, groups padded to 8 rows)
as on the per-expert loop (the reference transformers' parity runs on), and the clamped SwiGLU is
transformers' formula."""

import pytest
import torch

from titan_lightning.models.common.moe import CPU_GROUPED_MM, MoE
from titan_lightning.models.gpt_oss.model import gpt_oss_moe


def _moe(use_grouped_mm: bool) -> MoE:
    args = gpt_oss_moe(num_experts=8, top_k=2, hidden_dim=32, load_balance_coeff=None)
    args.use_grouped_mm, args.token_group_align = use_grouped_mm, 8
    torch.manual_seed(0)
    moe = MoE(64, args)
    with torch.no_grad():
        for p in moe.parameters():
            p.copy_(torch.randn_like(p) * 0.3)
    return moe


@pytest.mark.skipif(not CPU_GROUPED_MM, reason="this torch has no CPU grouped GEMM")
def test_grouped_experts_with_biases_equal_the_loop():
    x = torch.randn(2, 24, 64, generator=torch.Generator().manual_seed(1))
    outs, grads = [], []
    for grouped in (False, True):
        moe = _moe(grouped)
        out = moe(x)
        out.square().sum().backward()
        outs.append(out)
        grads.append({n: p.grad for n, p in moe.named_parameters()})
    torch.testing.assert_close(outs[1], outs[0], rtol=1e-5, atol=1e-5)
    for name in grads[0]:
        torch.testing.assert_close(grads[1][name], grads[0][name], rtol=1e-4, atol=1e-4, msg=name)
    assert grads[0]["experts.b2"].abs().max() > 0 and grads[0]["router.gate.bias"].abs().max() > 0


def test_the_clamped_swiglu_is_transformers():
    pytest.importorskip("transformers", reason="the reference implementation; a test-only extra")
    from transformers import GptOssConfig
    from transformers.models.gpt_oss.modeling_gpt_oss import GptOssExperts

    theirs = GptOssExperts(GptOssConfig(hidden_size=8, intermediate_size=16, num_local_experts=2))
    gate_up = torch.randn(5, 32) * 8  # past the limit of 7 on both sides
    experts = _moe(False).experts
    ours = experts.gated(gate_up[:, ::2], gate_up[:, 1::2])
    torch.testing.assert_close(ours, theirs._apply_gate(gate_up), rtol=0, atol=0)


def test_the_parameter_arithmetic_agrees_with_the_model():
    from titan_lightning.models.common.decoder import Decoder
    from titan_lightning.models.gpt_oss import Transformer, gpt_oss_args

    args = gpt_oss_args("debugmodel")
    for active in (False, True):
        assert Transformer.count_parameters(args, active=active) == \
            Decoder.count_parameters.__func__(Transformer, args, active=active)


def _tp_attention(rank: int, world_size: int) -> dict:
    """A gpt-oss attention (biases, sinks, a window) on TP over the thread ranks against one process."""
    from torch.distributed.device_mesh import init_device_mesh

    from titan_lightning.models.common.attention import ATTENTION_TP_PLAN
    from titan_lightning.models.gpt_oss.model import GptOssAttention
    from titan_lightning.parallel.tensor import apply_tp

    def build():  # (every draw from a generator of its own: the thread ranks share torch's global one)
        attention = GptOssAttention(64, 4, 2, head_dim=16)
        attention.window = 5
        g = torch.Generator().manual_seed(0)
        with torch.no_grad():
            for p in attention.parameters():
                p.copy_(0.1 * torch.randn(p.shape, generator=g))
        return attention

    x = torch.randn(2, 12, 64, generator=torch.Generator().manual_seed(1))
    rope = torch.randn(12, 8, 2, generator=torch.Generator().manual_seed(2))
    whole = build()
    expected = whole(x, rope)
    expected.square().sum().backward()
    sharded = build()
    plan = {**ATTENTION_TP_PLAN, "sinks": "head_params"}
    apply_tp(sharded, init_device_mesh("cpu", (world_size,)), plan, sequence_parallel=False, loss_parallel=False)
    out = sharded(x, rope)
    out.square().sum().backward()
    sinks = sharded.sinks.weight
    return {"out": (out - expected).abs().max().item(), "local_sinks": tuple(sinks.to_local().shape),
            "dsinks": (sinks.grad.full_tensor() - whole.sinks.weight.grad).abs().max().item(),
            "dbias_o": (sharded.wo.bias.grad.full_tensor() - whole.wo.bias.grad).abs().max().item()}


def test_the_sinks_shard_with_the_heads_under_tensor_parallelism():
    from titan_lightning.testing.threaded import run_threaded

    for result in run_threaded(_tp_attention, 2):
        assert result["local_sinks"] == (2,)
        assert max(result["out"], result["dsinks"], result["dbias_o"]) < 1e-5, result
