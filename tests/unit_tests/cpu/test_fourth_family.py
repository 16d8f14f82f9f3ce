"""A fourth family from the decoder base in this file alone (CONTRIBUTING "Add a model family"): a
parallel-residual block, on fsdp2_tp2 over 4 gloo ranks vs one process (the ranks import this file)."""

from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

from titan_lightning.config.job import ModelArgs
from titan_lightning.models.common.attention import ATTENTION_TP_PLAN, Attention
from titan_lightning.models.common.feedforward import FeedForward
from titan_lightning.models.common.decoder import Block, Decoder, decoder_tp_plan
from titan_lightning.models.common.rope import precompute_rope_cache
from titan_lightning.models.family import define_family
from titan_lightning.recipe import Run, debug_run, on_layout
from titan_lightning.testing.launch import launch, pythonpath_env, run_single


@dataclass(kw_only=True)
class TinyArgs(ModelArgs):
    dim: int = 64
    n_layers: int = 2
    hidden_dim: int = 128
    norm_eps: float = 1e-6
    max_seq_len: int = 64
    depth_init: bool = True


class ParallelBlock(Block):  # attention and feed-forward both read the block input
    def forward(self, x: torch.Tensor, rope_cache: torch.Tensor) -> torch.Tensor:
        return x + self.attention(self.attention_norm(x), rope_cache) + self.feed_forward(self.ffn_norm(x))


class TinyDecoder(Decoder):
    args_class = TinyArgs

    def build_block(self, layer_id: int) -> Block:
        a = self.args
        return ParallelBlock(a.dim, a.norm_eps, Attention(a.dim, a.n_heads, a.n_kv_heads, a.attention),
                             FeedForward(a.dim, a.hidden_dim))

    def build_rope_cache(self) -> torch.Tensor:
        a = self.args
        return precompute_rope_cache(a.dim // a.n_heads, a.max_seq_len, theta=10000.0)

    @classmethod
    def tp_plan(cls, args: TinyArgs) -> dict[str, str]:
        return decoder_tp_plan(ATTENTION_TP_PLAN)


TinyJob, TinyModule = define_family("Tiny", TinyArgs, module=__name__)  # (no Hugging Face adapter)


def single() -> Run:
    run = debug_run(TinyJob, TinyModule, TinyArgs())
    t = run.job.training
    t.seq_len, t.tokens_per_microbatch_per_dp_rank, t.deterministic = 64, 256, True
    run.trainer.update(max_steps=4, limit_val_batches=0, num_sanity_val_steps=0, enable_checkpointing=False)
    return run


def fsdp2_tp2() -> Run:
    return on_layout(single(), dp_shard=2, tp=2)


@pytest.mark.multi_process
def test_a_family_from_the_decoder_base_trains_on_fsdp2_tp2_as_on_one_process(tmp_path):
    env = pythonpath_env(Path(__file__).parent)
    fit = ["fit", "--trainer.accelerator", "cpu", "--recipe"]
    reference = run_single([*fit, "test_fourth_family:single"], out_dir=tmp_path / "one", timeout=300, env=env).ranks[0]
    assert len(reference["losses"]) == 4
    four = [*fit, "test_fourth_family:fsdp2_tp2", "--trainer.devices", "4"]
    for rank in launch(four, 4, out_dir=tmp_path / "four", timeout=300, env=env).ranks:
        assert rank["losses"] == pytest.approx(reference["losses"], rel=1e-5)
        assert rank["grad_norms"] == pytest.approx(reference["grad_norms"], rel=1e-4)


def test_the_family_counts_its_parameters_and_flops_without_writing_a_count():
    # The MFU metric asks flops_per_token -> flop_terms -> count_parameters (the Decoder default).
    args = TinyArgs()
    assert TinyDecoder.count_parameters(args) == sum(p.numel() for p in TinyDecoder(args).parameters())
    module = single().module
    head = args.dim // args.n_heads  # (TinyArgs has no head_dim: Attention's default)
    matmul = TinyDecoder.count_parameters(args, active=True) - args.vocab_size * args.dim
    assert module.flops_per_token(64) == 6 * matmul + 6 * args.n_layers * args.n_heads * 2 * head * 64
