"""apply_tp, apply_fsdp, apply_ddp and find_repeated_blocks.

Layouts are checked two ways: under the fake process group (one process pretends to be one
rank of a larger world: placements and local shard shapes), and with real gloo processes
that train 3 steps and must match a single process step for step.
"""

import contextlib
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor.parallel import loss_parallel
from torch.testing._internal.distributed.fake_pg import FakeStore

from titan_lightning.config import ParallelismConfig
from titan_lightning.models.llama3.model import Llama3Args, Transformer
from titan_lightning.models.llama3.parallelize import TP_PLAN
from titan_lightning.parallel.fsdp import apply_ddp, apply_fsdp, find_repeated_blocks
from titan_lightning.parallel.mesh import Mesh, ParallelDims
from titan_lightning.parallel.tensor import apply_tp
from titan_lightning.testing.launch import pythonpath_env
from titan_lightning.testing.spawn import run_function

# Small enough for 2 CPU cores; n_kv_heads < n_heads so GQA shards are checked too.
# head_dim 16, ffn_hidden_dim 192.
ARGS = Llama3Args(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=256, multiple_of=32, max_seq_len=64)
SEQ_LEN, GLOBAL_BATCH, STEPS, SEED, LR = 32, 4, 3, 0, 1e-2
WORKER_TIMEOUT_S = 120
FP32 = dict(param_dtype=torch.float32, reduce_dtype=torch.float32)


def meta_llama() -> Transformer:
    with torch.device("meta"):
        return Transformer(ARGS)


def materialize(model: nn.Module) -> nn.Module:
    model.to_empty(device="cpu")
    model.init_weights(SEED)
    return model


def build_mesh(world_size: int, **degrees) -> Mesh:
    return ParallelDims.from_config(ParallelismConfig(**degrees), world_size).build_mesh("cpu")


def fsdp_mesh(mesh: Mesh):
    """The FSDP mesh as a strategy would pick it: 2-D (dp_replicate, dp_shard) for HSDP (cp = 1 here)."""
    if mesh.dims.dp_replicate_enabled:
        return mesh.device_mesh["dp_replicate", "dp_shard"]
    return mesh.get("dp_shard_cp")


def shards_dim(placement, dim: int) -> bool:
    # FSDP on top of a TP shard of the same dim uses _StridedShard, which is not a Shard in torch 2.13.
    return type(placement).__name__ in ("Shard", "_StridedShard") and placement.dim == dim


@contextlib.contextmanager
def fake_world(world_size: int, rank: int = 1):
    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world_size)
    try:
        yield
    finally:
        dist.destroy_process_group()


@pytest.fixture
def fake_world_4():
    with fake_world(4):
        yield


@pytest.fixture
def fake_world_2():
    with fake_world(2):
        yield


def next_token_loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten(0, 1))


def tokens(batch: int = 2) -> torch.Tensor:
    return torch.randint(0, ARGS.vocab_size, (batch, SEQ_LEN), generator=torch.Generator().manual_seed(1))


# -- fake process group: placements and shard shapes ------------------------------------------

# FSDP dp_shard=2 over TP tp=2 with sequence parallelism, rank 1 of 4:
# name -> (TP placement, local shape).
FSDP2_TP2_SHARDS = {
    "tok_embeddings.weight": (Shard(0), (256 // 4, 64)),
    "attention_norm.weight": (Replicate(), (64 // 2,)),
    "attention.wq.weight": (Shard(0), (4 * 16 // 4, 64)),
    "attention.wk.weight": (Shard(0), (2 * 16 // 4, 64)),
    "attention.wv.weight": (Shard(0), (2 * 16 // 4, 64)),
    "attention.wo.weight": (Shard(1), (64 // 2, 64 // 2)),
    "ffn_norm.weight": (Replicate(), (64 // 2,)),
    "feed_forward.w1.weight": (Shard(0), (192 // 4, 64)),
    "feed_forward.w2.weight": (Shard(1), (64 // 2, 192 // 2)),
    "feed_forward.w3.weight": (Shard(0), (192 // 4, 64)),
    "norm.weight": (Replicate(), (64 // 2,)),
    "output.weight": (Shard(0), (256 // 4, 64)),
}


def block_free_name(fqn: str) -> str:
    parts = fqn.split(".")
    return ".".join(parts[2:]) if parts[0] == "layers" else fqn


def test_fsdp_over_tp_shards_every_parameter_on_both_dims(fake_world_4):
    mesh = build_mesh(4, dp_shard=2, tp=2)
    model = meta_llama()
    apply_tp(model, mesh.get("tp"), TP_PLAN, sequence_parallel=True, loss_parallel=False)
    apply_fsdp(model, mesh.get("dp_shard_cp"), **FP32)
    materialize(model)

    for fqn, param in model.named_parameters():
        tp_placement, local_shape = FSDP2_TP2_SHARDS[block_free_name(fqn)]
        assert isinstance(param, DTensor), fqn
        assert param.device_mesh.mesh_dim_names == ("dp_shard", "tp"), fqn
        dp_placement, got_tp_placement = param.placements
        assert shards_dim(dp_placement, 0), (fqn, dp_placement)
        assert got_tp_placement == tp_placement, fqn
        assert tuple(param.to_local().shape) == local_shape, fqn

    logits = model(tokens())
    assert logits.shape == (2, SEQ_LEN, ARGS.vocab_size) and not isinstance(logits, DTensor)
    next_token_loss(logits, tokens()).backward()
    for fqn, param in model.named_parameters():
        assert param.grad is not None and param.grad.to_local().shape == param.to_local().shape, fqn


@pytest.mark.parametrize("sequence_parallel", [False, True])
def test_tp_shards_heads_and_replicates_norms(fake_world_2, sequence_parallel):
    mesh = build_mesh(2, tp=2, sequence_parallel=sequence_parallel)
    model = meta_llama()
    apply_tp(model, mesh.get("tp"), TP_PLAN, sequence_parallel=sequence_parallel, loss_parallel=False)
    materialize(model)

    attention = model.layers["0"].attention
    assert attention.wq.weight.placements == (Shard(0),)
    assert attention.wq.weight.to_local().shape == (ARGS.n_heads // 2 * ARGS.head_dim, ARGS.dim)
    assert attention.wk.weight.to_local().shape == (ARGS.n_kv_heads // 2 * ARGS.head_dim, ARGS.dim)
    assert attention.wo.weight.placements == (Shard(1),)
    # Norm weights are replicated DTensors either way, so every parameter lives on the TP mesh.
    for norm in (model.norm, model.layers["0"].attention_norm, model.layers["1"].ffn_norm):
        assert norm.weight.placements == (Replicate(),) and norm.weight.to_local().shape == (ARGS.dim,)

    logits = model(tokens())
    assert not isinstance(logits, DTensor) and logits.shape == (2, SEQ_LEN, ARGS.vocab_size)
    next_token_loss(logits, tokens()).backward()
    assert all(isinstance(p.grad, DTensor) for p in model.parameters())


def test_loss_parallel_returns_vocab_sharded_logits_for_the_causal_lm_loss(fake_world_2):
    from titan_lightning.models.causal_lm import cross_entropy_loss

    mesh = build_mesh(2, tp=2)
    model = materialize(apply_tp(meta_llama(), mesh.get("tp"), TP_PLAN, sequence_parallel=True, loss_parallel=True))

    logits = model(tokens())
    assert isinstance(logits, DTensor) and logits.placements == (Shard(2),)
    assert logits.to_local().shape == (2, SEQ_LEN, ARGS.vocab_size // 2)
    with loss_parallel():
        loss = cross_entropy_loss(logits, tokens())
        loss.backward()
    assert isinstance(loss, DTensor) and loss.placements == (Replicate(),)
    assert model.output.weight.grad is not None


def test_tp_skips_plan_entries_whose_module_a_pipeline_stage_removed(fake_world_2):
    model = meta_llama()
    model.tok_embeddings, model.norm, model.output = None, None, None
    apply_tp(model, build_mesh(2, tp=2).get("tp"), TP_PLAN, sequence_parallel=True, loss_parallel=False)
    assert model.layers["1"].feed_forward.w1.weight.placements == (Shard(0),)


@pytest.mark.parametrize(
    ("policy", "unsharded_after_forward"),
    [("default", {"output"}), ("always", set()), ("never", {"tok_embeddings", "layers.0", "layers.1", "output"})],
)
def test_fsdp_reshard_after_forward_policy(fake_world_2, policy, unsharded_after_forward):
    model = meta_llama()
    apply_fsdp(model, build_mesh(2).get("dp_shard_cp"), **FP32, reshard_after_forward=policy)
    materialize(model)
    units = {"tok_embeddings": model.tok_embeddings, "output": model.output}
    units.update({f"layers.{i}": block for i, block in model.layers.items()})
    assert all(isinstance(unit, FSDPModule) for unit in [*units.values(), model.norm, model])

    with torch.no_grad():
        model(tokens())
    # A resharded unit holds its DTensor shards again; an unsharded one still the gathered tensors.
    unsharded = {name for name, unit in units.items() if not isinstance(next(unit.parameters()), DTensor)}
    assert unsharded == unsharded_after_forward


def test_fsdp_rejects_an_unknown_reshard_policy(fake_world_2):
    message = r"parallelism.fsdp_reshard_after_forward='sometimes' is not one of default, always, never"
    with pytest.raises(ValueError, match=message):
        apply_fsdp(meta_llama(), build_mesh(2).get("dp_shard_cp"), **FP32, reshard_after_forward="sometimes")


def test_tp_rejects_an_unknown_style_before_sharding_anything(fake_world_2):
    model = meta_llama()
    plan = {**TP_PLAN, "layers.*.attention.wq": "diagonal"}
    message = r"'layers.\*.attention.wq': unknown style 'diagonal'; valid styles are embedding, colwise"
    with pytest.raises(ValueError, match=message):
        apply_tp(model, build_mesh(2, tp=2).get("tp"), plan, sequence_parallel=True, loss_parallel=False)
    assert not isinstance(model.tok_embeddings.weight, DTensor)


def test_tp_rejects_a_pattern_that_matches_no_module(fake_world_2):
    plan = {"layers.*.attn.wq": "colwise"}
    message = r"TP plan pattern 'layers.\*.attn.wq' \(style 'colwise'\) matches no module of Transformer"
    with pytest.raises(ValueError, match=message):
        apply_tp(meta_llama(), build_mesh(2, tp=2).get("tp"), plan, sequence_parallel=True, loss_parallel=False)


def test_tp_rejects_a_weight_dim_the_tp_degree_does_not_divide(fake_world_2):
    model = nn.Sequential(nn.Linear(8, 5))
    message = r"splits dim 0 of 0.weight \(5, 8\), which is not divisible by parallelism.tp=2"
    with pytest.raises(ValueError, match=message):
        apply_tp(model, build_mesh(2, tp=2).get("tp"), {"0": "colwise"}, sequence_parallel=False, loss_parallel=False)


def test_ddp_rejects_a_mesh_smaller_than_the_world(fake_world_4):
    with pytest.raises(ValueError, match=r"DDP over parallelism.dp_replicate=2 ranks of a world of 4"):
        apply_ddp(meta_llama(), build_mesh(4, dp_replicate=2, dp_shard=1, tp=2).get("dp_replicate"))


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(8, 8)


class ToyNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(10, 8)
        self.blocks = nn.ModuleList(Block() for _ in range(3))
        self.heads = nn.ModuleDict({"a": nn.Linear(8, 2), "b": nn.Linear(8, 2)})  # fewer parameters
        self.mixed = nn.ModuleList([nn.Linear(8, 64), nn.Conv1d(8, 64, 3)])  # more, but not one class
        self.single = nn.ModuleList([nn.Linear(64, 64)])  # more, but only one


def test_find_repeated_blocks_picks_the_largest_uniform_container():
    model = ToyNet()
    assert find_repeated_blocks(model) == list(model.blocks)
    assert find_repeated_blocks(nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2))) == []
    llama = meta_llama()
    assert find_repeated_blocks(llama) == list(llama.layers.values())


# -- real gloo processes: 3 training steps against a single process ---------------------------------


@dataclass(frozen=True)
class Layout:
    world_size: int
    parallelism: ParallelismConfig
    loss_parallel: bool = False


LAYOUTS = {
    "fsdp2": Layout(2, ParallelismConfig(dp_shard=2)),
    "tp2": Layout(2, ParallelismConfig(tp=2, sequence_parallel=False)),
    "tp2_sp": Layout(2, ParallelismConfig(tp=2, sequence_parallel=True)),
    "tp2_sp_loss_parallel": Layout(2, ParallelismConfig(tp=2, sequence_parallel=True), loss_parallel=True),
    "ddp2": Layout(2, ParallelismConfig(dp_replicate=2, dp_shard=1)),
    "fsdp2_tp2": Layout(4, ParallelismConfig(dp_shard=2, tp=2, sequence_parallel=True), loss_parallel=True),
    "hsdp2x2": Layout(4, ParallelismConfig(dp_replicate=2, dp_shard=2)),
}


def global_batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(100 + step)
    data = torch.randint(0, ARGS.vocab_size, (GLOBAL_BATCH, SEQ_LEN + 1), generator=generator)
    return data[:, :-1], data[:, 1:]


def parallelize(model: nn.Module, mesh: Mesh, layout: Layout) -> nn.Module:
    """What a strategy does, in torchtitan's order: TP, then FSDP/HSDP or DDP."""
    dims, p = mesh.dims, layout.parallelism
    if dims.tp_enabled:
        apply_tp(
            model, mesh.get("tp"), TP_PLAN, sequence_parallel=p.sequence_parallel, loss_parallel=layout.loss_parallel
        )
    if dims.fsdp_enabled:
        apply_fsdp(model, fsdp_mesh(mesh), **FP32)
    elif dims.dp_replicate_enabled:
        apply_ddp(model, mesh.get("dp_replicate"))
    return model


def train(model: nn.Module, batches, *, loss_parallel_enabled: bool = False, dp_group=None) -> dict[str, list[float]]:
    """STEPS of AdamW; per step the loss (mean over dp) and the pre-clip grad norm."""
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.1, foreach=False)
    losses, grad_norms = [], []
    for inputs, labels in batches:
        with loss_parallel() if loss_parallel_enabled else contextlib.nullcontext():
            loss = next_token_loss(model(inputs), labels)
            loss.backward()
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm=1e9, foreach=True)
        optimizer.step()
        optimizer.zero_grad()
        loss = (loss.full_tensor() if isinstance(loss, DTensor) else loss).detach().clone()
        if dp_group is not None:
            dist.all_reduce(loss, group=dp_group)
            loss /= dist.get_world_size(dp_group)
        losses.append(loss.item())
        grad_norms.append((norm.full_tensor() if isinstance(norm, DTensor) else norm).item())
    return {"loss": losses, "grad_norm": grad_norms}


def train_layout(name: str) -> dict[str, list[float]]:
    layout = LAYOUTS[name]
    mesh = ParallelDims.from_config(layout.parallelism, layout.world_size).build_mesh("cpu")
    model = materialize(parallelize(meta_llama(), mesh, layout))
    dp_rank, dp_size = mesh.rank_and_size("dp")
    rows = slice(dp_rank * GLOBAL_BATCH // dp_size, (dp_rank + 1) * GLOBAL_BATCH // dp_size)
    batches = [tuple(t[rows] for t in global_batch(step)) for step in range(STEPS)]
    dp = mesh.get("dp")
    dp_group = None if dp is None else dp.get_group()
    return train(model, batches, loss_parallel_enabled=layout.loss_parallel, dp_group=dp_group)


def train_layouts(*, rank: int, world_size: int, names: list[str]) -> dict[str, dict[str, list[float]]]:
    """Run on each rank by titan_lightning.testing.spawn: every layout in ``names``, one after another."""
    return {name: train_layout(name) for name in names}


# The ranks import this file as a top-level module (their interpreter was started before this test).
HERE_ENV = pythonpath_env(Path(__file__).parent)


def spawn(world_size: int, names: list[str], out_dir: Path) -> dict[str, dict[str, list[float]]]:
    """Run ``names`` in one gloo world of ranks forked by the launcher; killed if they outlive the timeout."""
    return run_function(f"{Path(__file__).stem}:train_layouts", world_size, out_dir=out_dir,
                        timeout=WORKER_TIMEOUT_S, env=HERE_ENV, names=names)[0]


@pytest.fixture(scope="module")
def reference() -> dict[str, list[float]]:
    return train(materialize(meta_llama()), [global_batch(step) for step in range(STEPS)])


@pytest.fixture(scope="module")
def parallel_runs(tmp_path_factory):
    """world size -> results of every layout of that size, spawned once per module."""
    runs: dict[int, object] = {}

    def run(world_size: int) -> dict[str, dict[str, list[float]]]:
        if world_size not in runs:
            names = [name for name, layout in LAYOUTS.items() if layout.world_size == world_size]
            try:
                runs[world_size] = spawn(world_size, names, tmp_path_factory.mktemp(f"world{world_size}"))
            except Exception as error:  # noqa: BLE001 - reported by every test of this world size
                runs[world_size] = error
        if isinstance(runs[world_size], Exception):
            raise runs[world_size]
        return runs[world_size]

    return run


@pytest.mark.multi_process
@pytest.mark.parametrize("name", LAYOUTS)
def test_parallel_training_matches_a_single_process(name, parallel_runs, reference):
    got = parallel_runs(LAYOUTS[name].world_size)[name]
    assert got["loss"] == pytest.approx(reference["loss"], rel=1e-5)
    assert got["grad_norm"] == pytest.approx(reference["grad_norm"], rel=1e-4)
    # The steps must change something, or matching would prove little.
    assert reference["loss"][0] != pytest.approx(reference["loss"][-1], rel=1e-3)
