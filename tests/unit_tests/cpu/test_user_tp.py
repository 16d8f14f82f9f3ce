"""Tensor parallelism on a user's own module, from the plan it declares.

Head counts become per-rank (found by name, or declared as 'heads'); a fused projection is
sharded block by block ('colwise_fused:N') and checkpointed whole; a module whose reshape still
fails under TP is named, with what to declare. The in-process tests run one rank of two (or of
2 x 2) under the fake process group (no collective is real, local shapes are); the multi-process
tests train on two real gloo ranks against one process, and resume from their sharded checkpoint
on two ranks and on one.
"""

import contextlib
import copy
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor.placement_types import _StridedShard
from torch.testing._internal.distributed.fake_pg import FakeStore

from titan_lightning.checkpoint import CheckpointError, dcp_saveable
from titan_lightning.config import ConfigError
from titan_lightning.parallel.tensor import TensorParallelShapeError, apply_tp, check_tp_plan
from titan_lightning.testing.launch import launch, pythonpath_env, run_single
from user_gpt import Config, GPTModule

TP = 2


@contextlib.contextmanager
def tp_mesh(rank: int = 1):
    """Rank ``rank`` of a fake world of TP ranks, and its 1-D mesh."""
    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=TP)
    try:
        yield init_device_mesh("cpu", (TP,))
    finally:
        dist.destroy_process_group()


def apply(module: nn.Module, plan: dict, mesh, sequence_parallel: bool = False) -> nn.Module:
    return apply_tp(module, mesh, plan, sequence_parallel=sequence_parallel, loss_parallel=False)


def tokens(vocab_size: int = 128) -> torch.Tensor:
    return torch.randint(0, vocab_size, (2, 32), generator=torch.Generator().manual_seed(3))


# -- head counts -------------------------------------------------------------------------------


def test_head_counts_on_a_shared_config_are_divided_once_and_hidden_sizes_kept():
    module = GPTModule()
    with tp_mesh() as mesh:
        apply(module, GPTModule.tp_plan, mesh, sequence_parallel=True)
        config = module.config
        assert config is module.model.h[1].attn.config is module.model.h[0].mlp.config  # one object
        assert (config.n_head, config.n_query_groups) == (2, 2)
        assert (config.n_embd, config.head_size, config.intermediate_size) == (64, 16, 96)
        assert module.model.h[0].attn.qkv.weight.to_local().shape == (3 * 2 * 16, 64)
        logits = module(tokens())  # every reshape runs on the local heads
    assert logits.shape == (2, 32, 128)


def test_an_mlp_only_plan_leaves_the_head_counts_of_a_shared_config_alone():
    """LitGPT's MLP holds the config every block shares, but does not read its head counts: they
    stay global for the attention, which the plan does not shard (grouped-query attention too)."""
    module = GPTModule(Config(n_head=4, n_query_groups=2))
    with tp_mesh() as mesh:
        apply(module, GPTModule.MLP_PLAN, mesh)
        assert (module.config.n_head, module.config.n_query_groups) == (4, 2)
        assert module.model.h[0].mlp.fc_1.weight.to_local().shape == (48, 64)
        assert not isinstance(module.model.h[0].attn.qkv.weight, DTensor)
        assert module(tokens()).shape == (2, 32, 128)


def test_sharding_the_heads_of_some_modules_that_read_a_shared_config_is_refused():
    plan = {**GPTModule.MLP_PLAN, "model.h.0.attn.qkv": "colwise_fused:3", "model.h.0.attn.proj": "rowwise"}
    message = (r"^model.h.0.attn.config.n_head counts heads and the tp_plan shards heads of modules that read it, "
               r"but the same Config object is read by model.h.1.attn \(CausalSelfAttention\), which the plan does "
               r"not shard: .*shard the projections of every module that reads it, or none of them")
    module = GPTModule()
    with pytest.raises(ConfigError, match=message):
        check_tp_plan(module, plan, TP, sequence_parallel=False)
    assert module.config.n_head == 4


@pytest.mark.parametrize("style", ["colwise", "colwise_fused:2"])
def test_a_colwise_style_that_mixes_the_stacked_q_and_k_rows_is_refused_before_sharding(style):
    """LitGPT's qkv rows are [all q; all k; all v]: plain colwise would give rank 0 all of q and half of k."""
    module = GPTModule()
    plan = {**GPTModule.tp_plan, "model.h.*.attn.qkv": style}
    message = (rf"^tp_plan entry 'model.h.\*.attn.qkv': style '{style}' on model.h.0.attn.qkv \(192 output rows: "
               r"\(4 heads \+ 2 x 4 query groups\) x head size 16, as model.h.0.attn \(CausalSelfAttention\) "
               r"declares\) "
               r"would give each rank the wrong rows .*: use 'colwise_fused:3' \(rank r computes \[q_r; k_r; v_r\]\); "
               r"rows grouped per query group .* are sharded right by 'colwise_grouped'$")
    with pytest.raises(ConfigError, match=message):
        check_tp_plan(module, plan, TP, sequence_parallel=True)
    with tp_mesh() as mesh, pytest.raises(ConfigError, match=message):
        apply(module, plan, mesh, sequence_parallel=True)
    assert not isinstance(module.model.wte.weight, DTensor) and module.config.n_head == 4


def test_stacked_qkv_of_grouped_query_attention_is_refused_with_the_mlp_only_way_out():
    module = GPTModule(Config(n_head=4, n_query_groups=2))
    message = (r"style 'colwise_fused:3' on model.h.0.attn.qkv \(128 output rows: .*under grouped-query attention its "
               r"blocks are of unequal size \(q 64 rows, k and v 32 each\), which 'colwise_fused' \(equal blocks\) "
               r"cannot split: leave model.h.0.attn's projections out of tp_plan and shard the MLP only;")
    with pytest.raises(ConfigError, match=message):
        check_tp_plan(module, GPTModule.tp_plan, TP, sequence_parallel=True)


def test_colwise_grouped_declares_rows_grouped_per_query_group():
    """The same shapes with rows grouped per query group (GPT-NeoX): plain colwise is right there."""
    plan = {**GPTModule.tp_plan, "model.h.*.attn.qkv": "colwise_grouped"}
    check_tp_plan(GPTModule(), plan, TP, sequence_parallel=True)


def test_a_head_count_the_tp_degree_does_not_divide_is_refused_before_sharding():
    module = GPTModule(Config(n_head=3, n_query_groups=3))
    message = r"model.h.0.attn.config.n_head=3 is not divisible by 2; choose a tp that divides 3$"
    with pytest.raises(ConfigError, match=message):
        check_tp_plan(module, GPTModule.tp_plan, TP, sequence_parallel=True)
    with tp_mesh() as mesh, pytest.raises(ConfigError, match=message):
        apply(module, GPTModule.tp_plan, mesh, sequence_parallel=True)
    assert not isinstance(module.model.wte.weight, DTensor) and module.config.n_head == 3


class NanoAttention(nn.Module):
    """nanoGPT's attention: q, k, v split by the hidden size, head size from the input's width."""

    def __init__(self, n_embd: int = 64, n_head: int = 4) -> None:
        super().__init__()
        self.n_embd, self.n_head = n_embd, n_head
        self.c_attn = nn.Linear(n_embd, 3 * n_embd)
        self.c_proj = nn.Linear(n_embd, n_embd)

    def forward(self, x):
        B, T, C = x.size()
        q, k, v = self.c_attn(x).split(self.n_embd, dim=2)
        q, k, v = (t.view(B, T, self.n_head, C // self.n_head).transpose(1, 2) for t in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.c_proj(y.transpose(1, 2).contiguous().view(B, T, C))


class ChunkAttention(nn.Module):
    """Rows [all q; all k; all v] as in nanoGPT, but split into thirds, reshaped with a head count
    stored under a name of its own (``heads``) and a head size, and -1 for the width."""

    def __init__(self, n_embd: int = 64, heads: int = 4) -> None:
        super().__init__()
        self.heads, self.head_size = heads, n_embd // heads
        self.c_attn = nn.Linear(n_embd, 3 * n_embd)
        self.c_proj = nn.Linear(n_embd, n_embd, bias=False)

    def forward(self, x):
        B, T, _ = x.shape
        q, k, v = (t.view(B, T, self.heads, self.head_size).transpose(1, 2) for t in self.c_attn(x).chunk(3, dim=-1))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.c_proj(y.transpose(1, 2).reshape(B, T, -1))


def blocks(attention: type) -> nn.Module:
    torch.manual_seed(0)
    return nn.ModuleDict({"h": nn.ModuleList(nn.ModuleDict({"attn": attention()}) for _ in range(2))})


PLAN = {"h.*.attn.c_attn": "colwise", "h.*.attn.c_proj": "rowwise"}
FUSED_PLAN = {**PLAN, "h.*.attn.c_attn": "colwise_fused:3"}


def test_a_reshape_that_fails_under_tp_names_the_module_and_what_to_declare():
    model = blocks(ChunkAttention)
    x = torch.randn(2, 8, 64)
    with tp_mesh() as mesh:
        apply(model, FUSED_PLAN, mesh)
        with pytest.raises(TensorParallelShapeError) as failed:
            model["h"][0]["attn"](x)
    message = str(failed.value)
    assert message.startswith("h.0.attn (ChunkAttention): its forward failed under parallelism.tp=2 "
                              "(shape '[2, 8, 4, 16]' is invalid")
    assert "declare them in tp_plan as 'h.0.attn.<attr>': 'heads'" in message
    assert "\n" not in message and isinstance(failed.value.__cause__, RuntimeError)


def test_declaring_the_head_count_it_asks_for_makes_the_forward_run():
    model = blocks(ChunkAttention)
    with tp_mesh() as mesh:
        apply(model, {**FUSED_PLAN, "h.*.attn.heads": "heads"}, mesh)
        assert [model["h"][i]["attn"].heads for i in (0, 1)] == [2, 2]
        assert model["h"][1]["attn"](torch.randn(2, 8, 64)).shape == (2, 8, 64)


def test_nanogpt_attention_under_plain_colwise_is_refused_with_a_pointer_to_fused_projections():
    """Its width (n_embd 64) and head count (n_head 4) say c_attn's 192 rows are q, k and v."""
    message = (r"^tp_plan entry 'h.\*.attn.c_attn': style 'colwise' on h.0.attn.c_attn \(192 output rows: \(4 heads \+ "
               r"2 x 4 query groups\) x head size 16, as h.0.attn \(NanoAttention\) declares\) .*use 'colwise_fused:3'")
    with pytest.raises(ConfigError, match=message):
        check_tp_plan(blocks(NanoAttention), PLAN, TP, sequence_parallel=False)


def test_nanogpt_attention_under_colwise_fused_names_the_reshape_to_fix():
    """nanoGPT splits c_attn's output by n_embd, a global width: the forward fails, and says what to do."""
    model = blocks(NanoAttention)
    with tp_mesh() as mesh:
        apply(model, FUSED_PLAN, mesh)
        assert model["h"][0]["attn"].n_head == 2 and model["h"][0]["attn"].n_embd == 64
        with pytest.raises(TensorParallelShapeError, match=r"^h.0.attn \(NanoAttention\): ") as failed:
            model["h"][0]["attn"](torch.randn(2, 8, 64))
    assert "made per-rank: h.0.attn.n_head 4 -> 2" in str(failed.value)
    assert "Sizes read from a hidden size or the input's width (split(n_embd)" in str(failed.value)


def test_fused_qkv_shards_each_third_and_the_rank_partials_sum_to_one_process():
    """Rank r's c_attn output is [q_r, k_r, v_r]; its weight stays the user's [q; k; v] layout
    (a strided shard); the rowwise partial outputs of the two ranks add up to one process."""
    reference = blocks(ChunkAttention)
    x = torch.randn(2, 8, 64, generator=torch.Generator().manual_seed(2))
    q, k, v = reference["h"][0]["attn"].c_attn(x).chunk(3, dim=-1)
    expected, partials = reference["h"][0]["attn"](x), []
    plan = {**FUSED_PLAN, "h.*.attn.heads": "heads"}
    for rank in range(TP):
        model = copy.deepcopy(reference)
        with tp_mesh(rank) as mesh:
            apply(model, plan, mesh)
            attn = model["h"][0]["attn"]
            mine = slice(rank * 32, (rank + 1) * 32)
            assert torch.equal(attn.c_attn(x), torch.cat([q[..., mine], k[..., mine], v[..., mine]], dim=-1))
            assert type(attn.c_attn.weight.placements[0]).__name__ == "_StridedShard"
            partials.append(attn(x))  # the fake all-reduce leaves each rank's partial sum
    torch.testing.assert_close(partials[0] + partials[1], expected, rtol=1e-5, atol=1e-6)


def test_a_sequence_parallel_plan_without_norms_is_refused():
    with tp_mesh() as mesh, pytest.raises(ConfigError, match=r"sequence_parallel=True, but the TP plan has rowwise"):
        apply(blocks(ChunkAttention), FUSED_PLAN, mesh, sequence_parallel=True)


# -- checkpoints ----------------------------------------------------------------------------------


def test_a_sharded_checkpoint_holds_a_fused_projection_replicated_and_the_rest_as_their_shards():
    """DCP takes a rank's shard for one block of the tensor; a fused projection's is [q_r; k_r; v_r]."""
    module = GPTModule()
    with tp_mesh() as mesh:
        apply(module, GPTModule.tp_plan, mesh, sequence_parallel=True)
        params = dict(module.named_parameters())
        saved = dcp_saveable({"state_dict": params})["state_dict"]
        fused = saved["model.h.0.attn.qkv.weight"]
        assert fused.placements == (Replicate(),) and fused.to_local().shape == (192, 64)
        assert all(saved[name] is param for name, param in params.items() if ".attn.qkv." not in name)


def test_a_checkpoint_of_fsdp_over_a_fused_projection_is_refused():
    """FSDP over TP's strided shard gives placements that do not say where the rows are."""
    dist.init_process_group("fake", store=FakeStore(), rank=1, world_size=4)
    try:
        mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp_shard", "tp"))
        fsdp_over_colwise = DTensor.from_local(torch.zeros(32, 64), mesh, [_StridedShard(0, split_factor=2), Shard(0)],
                                               shape=(128, 64), stride=(64, 1))
        assert dcp_saveable(fsdp_over_colwise) is fsdp_over_colwise  # DCP's own case: one block per rank
        over_fused = DTensor.from_local(torch.zeros(48, 64), mesh, [_StridedShard(0, split_factor=2)] * 2,
                                        shape=(192, 64), stride=(64, 1))
        with pytest.raises(CheckpointError, match=r"^fc.weight \(192, 64\): FSDP \(parallelism.dp_shard > 1\) over "
                                                  r"the TP style 'colwise_fused' .* would hold them out of order"):
            dcp_saveable({"fc.weight": over_fused})
    finally:
        dist.destroy_process_group()


# -- two real ranks against one process ------------------------------------------------------------


USER_ENV = pythonpath_env(Path(__file__).parent)


def _relative(a: float, b: float) -> float:
    return abs(a - b) / max(abs(b), 1e-12)


@pytest.fixture(scope="module")
def one_process(tmp_path_factory):
    """The reference: one process, 5 steps."""
    out = tmp_path_factory.mktemp("single")
    (rank,) = run_single(["fit", "--recipe", "user_gpt:single"], out_dir=out, timeout=300, env=USER_ENV).ranks
    assert len(set(rank["losses"])) == 5  # five steps, each on weights the last one changed
    assert rank["metrics"]["probe/n_head"] == 4.0
    return rank


def _assert_matches(ranks: list[dict], expected: dict) -> None:
    for rank in ranks:
        assert len(rank["losses"]) == 5
        for name in ("losses", "grad_norms"):
            for value, ref in zip(rank[name], expected[name], strict=True):
                assert _relative(value, ref) < 1e-5, (name, rank[name], expected[name])


@pytest.mark.multi_process
def test_users_litgpt_style_module_on_two_tp_ranks_matches_one_process(one_process, tmp_path):
    """The whole plan: qkv 'colwise_fused:3', the head counts of the shared config per-rank."""
    ranks = launch(["fit", "--recipe", "user_gpt:tp2", "--trainer.devices", "2"], 2, out_dir=tmp_path, timeout=300,
                   env=USER_ENV).ranks
    assert [rank["metrics"]["probe/n_head"] for rank in ranks] == [2.0, 2.0]  # each rank's local heads
    _assert_matches(ranks, one_process)


@pytest.mark.multi_process
def test_an_mlp_only_plan_on_two_tp_ranks_matches_one_process(one_process, tmp_path):
    """Only the MLP sharded: the attention, reading the same config, keeps every head."""
    ranks = launch(["fit", "--recipe", "user_gpt:tp2_mlp", "--trainer.devices", "2"], 2, out_dir=tmp_path,
                   timeout=300, env=USER_ENV).ranks
    assert [rank["metrics"]["probe/n_head"] for rank in ranks] == [4.0, 4.0]
    _assert_matches(ranks, one_process)


@pytest.mark.multi_process
def test_a_sharded_checkpoint_with_a_fused_projection_resumes_exactly_on_tp_ranks_and_on_one_process(tmp_path):
    """Two TP ranks (the attention's [q; k; v] is 'colwise_fused:3') save a sharded checkpoint at step 3
    of 5 (Lightning's ModelCheckpoint); resumed from it, two TP ranks redo steps 4 and 5 bit for
    bit, one process within 1e-6."""
    tp2 = ["fit", "--recipe", "user_gpt:tp2", "--trainer.devices", "2"]
    ckpt = tmp_path / "ckpt"
    (uninterrupted, _) = launch(tp2, 2, out_dir=tmp_path / "tp2", timeout=300,
                                env={**USER_ENV, "USER_GPT_CHECKPOINTS": str(ckpt)}).ranks
    saved = ckpt / "epoch=0-step=3.ckpt"
    assert sorted(p.name for p in saved.glob("*.distcp")) == ["__0_0.distcp", "__1_0.distcp"]
    resume = {**USER_ENV, "USER_GPT_RESUME": str(saved)}
    with ThreadPoolExecutor(1) as pool:  # the one-process resume runs beside the two ranks
        single = pool.submit(run_single, ["fit", "--recipe", "user_gpt:single"], out_dir=tmp_path / "single",
                             timeout=300, env=resume)
        resumed = launch(tp2, 2, out_dir=tmp_path / "resumed", timeout=300, env=resume).ranks
        one_process = single.result().ranks[0]
    for rank in resumed:
        assert rank["steps"] == [4, 5]
        assert (rank["losses"], rank["grad_norms"]) == (uninterrupted["losses"][3:], uninterrupted["grad_norms"][3:])
    assert one_process["steps"] == [4, 5]
    for name in ("losses", "grad_norms"):
        for value, ref in zip(one_process[name], uninterrupted[name][3:], strict=True):
            assert _relative(value, ref) < 1e-6, (name, one_process[name], uninterrupted[name])


def test_colwise_fused_with_fsdp_is_refused_before_launch():
    """FSDP over a colwise_fused weight trains right but its placements misdescribe the rows."""
    import lightning as L
    from user_gpt import GPTModule

    from titan_lightning.config import ConfigError
    from titan_lightning.strategies import TitanStrategy

    strategy = TitanStrategy(dp_shard=2, tp=2)
    L.Trainer(strategy=strategy, accelerator="cpu", devices=4, logger=False)
    with pytest.raises(ConfigError, match=r"\['model.h.\*.attn.qkv'\] \(colwise_fused\) do not compose with FSDP"):
        strategy.check_module(GPTModule())


def test_plain_colwise_on_litgpts_qkv_is_refused_by_the_strategy_before_launch():
    import lightning as L

    from titan_lightning.strategies import TitanStrategy

    strategy = TitanStrategy(dp_shard=1, tp=2)
    L.Trainer(strategy=strategy, accelerator="cpu", devices=2, logger=False)
    message = r"^tp_plan entry 'model.h.\*.attn.qkv': style 'colwise' on .*'colwise_fused:3'"
    with pytest.raises(ConfigError, match=message):
        strategy.check_module(GPTModule(tp_plan={**GPTModule.tp_plan, "model.h.*.attn.qkv": "colwise"}))
