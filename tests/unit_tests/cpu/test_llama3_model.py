import threading

import pytest
import torch
import torch.distributed as dist
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor
from torch.testing._internal.distributed.fake_pg import FakeStore

from titan_lightning.models.llama3 import (
    LLAMA3_PRESETS,
    Llama3Args,
    RopeScaling,
    Transformer,
    llama3_args,
)

from tests.decoders import assert_causal, materialized, meta_model

# Hugging Face safetensors totals (exact): meta-llama/Llama-3.2-1B 1,235,814,400 and
# Llama-3.2-3B 3,212,749,824 (both tied, so + vocab_size * dim for our untied output),
# Llama-3.1-8B 8,030,261,248, Llama-3.1-70B 70,553,706,496, Llama-3.1-405B 405,853,388,800.
# They are the same arithmetic over the same shapes, so the tolerance is zero.
PUBLISHED_PARAMS = {
    "1B": 1_235_814_400 + 128256 * 2048,
    "3B": 3_212_749_824 + 128256 * 3072,
    "8B": 8_030_261_248,
    "70B": 70_553_706_496,
    "405B": 405_853_388_800,
}
# intermediate_size in the Hugging Face configs.
PUBLISHED_FFN_HIDDEN = {"1B": 8192, "3B": 8192, "8B": 14336, "70B": 28672, "405B": 53248}


def assert_same_weights(a: torch.nn.Module, b: torch.nn.Module) -> None:
    sa, sb = dict(a.named_parameters()), dict(b.named_parameters())
    assert sa.keys() == sb.keys()
    for name in sa:
        assert torch.equal(sa[name], sb[name]), name


@pytest.fixture
def fake_pg():
    rank, world_size = 1, 4
    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world_size)
    yield rank, world_size
    dist.destroy_process_group()


@pytest.mark.parametrize("flavor", PUBLISHED_PARAMS)
def test_parameter_count_matches_published(flavor):
    args = llama3_args(flavor)
    assert args.ffn_hidden_dim == PUBLISHED_FFN_HIDDEN[flavor]
    assert Transformer.count_parameters(args) == PUBLISHED_PARAMS[flavor]
    assert sum(p.numel() for p in meta_model(args).parameters()) == PUBLISHED_PARAMS[flavor]


def test_debugmodel_parameter_count_is_arithmetic():
    args = llama3_args("debugmodel")
    assert Transformer.count_parameters(args) == sum(p.numel() for p in Transformer(args).parameters()) == 6_163_712


def test_module_names_follow_torchtitan():
    model = meta_model(llama3_args("debugmodel"))
    names = {n for n, _ in model.named_parameters()}
    layer = {
        "attention.wq.weight", "attention.wk.weight", "attention.wv.weight", "attention.wo.weight",
        "feed_forward.w1.weight", "feed_forward.w2.weight", "feed_forward.w3.weight",
        "attention_norm.weight", "ffn_norm.weight",
    }  # fmt: skip
    expected = {"tok_embeddings.weight", "norm.weight", "output.weight"}
    expected |= {f"layers.{i}.{n}" for i in range(6) for n in layer}
    assert names == expected
    assert isinstance(model.layers, torch.nn.ModuleDict)
    assert "rope_cache" not in model.state_dict()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_forward_returns_logits_per_token_in_param_dtype(dtype):
    args = llama3_args("debugmodel")
    model = materialized(args, seed=0, dtype=dtype)
    logits = model(torch.randint(0, args.vocab_size, (2, 32)))
    assert logits.shape == (2, 32, args.vocab_size)
    assert logits.dtype == dtype
    assert torch.isfinite(logits).all()


def test_forward_is_causal():
    args = llama3_args("debugmodel")
    assert_causal(materialized(args, seed=0), args.vocab_size)


def test_pipeline_stage_without_embeddings_or_output_passes_hidden_states():
    args = llama3_args("debugmodel")
    model = materialized(args, seed=0)
    model.tok_embeddings = model.output = None
    del model.layers["5"]
    h = torch.randn(2, 8, args.dim)
    assert model(h).shape == (2, 8, args.dim)


def test_init_is_bitwise_deterministic_per_seed():
    args = llama3_args("debugmodel")
    assert_same_weights(materialized(args, seed=3), materialized(args, seed=3))
    a, b = materialized(args, seed=3), materialized(args, seed=4)
    for (name, p), q in zip(a.named_parameters(), b.parameters()):
        assert torch.equal(p, q) == name.endswith("norm.weight"), name  # norms are ones whatever the seed


def test_init_on_meta_then_cpu_equals_init_of_a_cpu_model():
    args = llama3_args("debugmodel")
    direct = Transformer(args)
    direct.init_weights(7)
    from_meta = materialized(args, seed=7)
    assert_same_weights(direct, from_meta)
    assert torch.equal(direct.rope_cache, from_meta.rope_cache)


def test_init_ignores_the_default_device():
    """Lightning runs configure_model under a default-device context (cuda on a GPU)."""
    args = llama3_args("debugmodel")
    plain = materialized(args, seed=7)
    with torch.device("meta"):
        model = Transformer(args)
    model.to_empty(device="cpu")
    with torch.device("meta"):  # a foreign default device while the weights are drawn
        model.init_weights(7)
    assert_same_weights(plain, model)
    assert torch.equal(plain.rope_cache, model.rope_cache)


@pytest.mark.parametrize("ahead_bytes", [0, 1 << 20])
def test_init_drawn_on_threads_is_the_one_thread_init(monkeypatch, ahead_bytes):
    """A large model draws on several threads, at most ``DRAW_AHEAD_BYTES`` of values waiting (0: one
    at a time): bitwise the weights of one thread, each from its own (seed, name) generator."""
    from titan_lightning.models.common import init

    args = llama3_args("debugmodel")
    one = materialized(args, seed=5)
    monkeypatch.setattr(init, "PARALLEL_DRAW_NUMEL", 0)
    monkeypatch.setattr(init, "DRAW_AHEAD_BYTES", ahead_bytes)
    monkeypatch.setattr(init, "draw_threads", lambda: 3)
    drawn_on = set()
    law = Transformer.init_param

    def recording(self, fqn, w, g):
        drawn_on.add(threading.current_thread().name)
        law(self, fqn, w, g)

    monkeypatch.setattr(Transformer, "init_param", recording)
    assert_same_weights(one, materialized(args, seed=5))
    assert drawn_on and all(name.startswith("init") for name in drawn_on)


def test_init_in_bfloat16_is_the_float32_init_rounded():
    args = llama3_args("debugmodel")
    full, half = materialized(args, seed=1), materialized(args, seed=1, dtype=torch.bfloat16)
    assert_same_weights(full.to(torch.bfloat16), half)
    assert half.rope_cache.dtype == torch.float32


@pytest.mark.filterwarnings("ignore::DeprecationWarning")  # torch.compile imports inductor
def test_init_ignores_checkpoint_and_compile_wrappers():
    args = llama3_args("debugmodel")
    wrapped = meta_model(args)
    wrapped.layers["0"] = checkpoint_wrapper(wrapped.layers["0"])
    wrapped.layers["1"] = torch.compile(wrapped.layers["1"])  # never called: nothing compiles
    wrapped.to_empty(device="cpu")
    wrapped.init_weights(5)
    plain = materialized(args, seed=5)
    for name, p in wrapped.named_parameters():
        name = name.replace("_checkpoint_wrapped_module.", "").replace("_orig_mod.", "")
        assert torch.equal(p, plain.get_parameter(name)), name


def test_init_follows_torchtitan_laws():
    args = llama3_args("debugmodel")
    m = materialized(args, seed=0)
    assert m.tok_embeddings.weight.std().item() == pytest.approx(1.0, rel=0.02)
    assert m.layers["0"].attention.wq.weight.std().item() == pytest.approx(0.02, rel=0.02)
    for i in ("0", "5"):  # depth_init: 0.02 / sqrt(2 * (layer_id + 1))
        std = 0.02 / (2 * (int(i) + 1)) ** 0.5
        assert m.layers[i].feed_forward.w2.weight.std().item() == pytest.approx(std, rel=0.02)
    out_std = args.dim**-0.5
    assert m.output.weight.abs().max().item() <= 3 * out_std
    assert torch.equal(m.norm.weight, torch.ones(args.dim))
    flat = materialized(Llama3Args(depth_init=False), seed=0)
    assert flat.layers["0"].attention.wo.weight.std().item() == pytest.approx(0.02 / 12**0.5, rel=0.02)


def test_init_of_fsdp_sharded_model_keeps_this_ranks_chunk_of_the_full_init(fake_pg):
    rank, world_size = fake_pg
    args = Llama3Args(vocab_size=2050, n_layers=2)  # 2050 rows: uneven chunks of 513, 513, 513, 511
    mesh = init_device_mesh("cpu", (world_size,))
    model = meta_model(args)
    for layer in model.layers.values():
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    model.to_empty(device="cpu")
    model.init_weights(11)
    full = Transformer(args)
    full.init_weights(11)
    for name, p in model.named_parameters():
        assert isinstance(p, DTensor), name
        assert torch.equal(p.to_local(), full.get_parameter(name).chunk(world_size)[rank]), name


def test_llama3_args_returns_a_fresh_copy():
    args = llama3_args("8B")
    args.rope_scaling.factor = 1.0
    assert LLAMA3_PRESETS["8B"].rope_scaling.factor == 8.0
    assert llama3_args("8B") == LLAMA3_PRESETS["8B"]


def test_default_args_are_the_debugmodel():
    assert Llama3Args() == LLAMA3_PRESETS["debugmodel"]


def test_unknown_flavor_names_it_and_the_valid_ones():
    with pytest.raises(ValueError, match=r"'nope'.*debugmodel, 1B, 3B, 8B, 70B, 405B"):
        llama3_args("nope")


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(dim=0), r"model\.dim=0 must be a positive integer"),
        (dict(n_layers=-1), r"model\.n_layers=-1 must be a positive integer"),
        (dict(multiple_of=2.5), r"model\.multiple_of=2\.5 must be a positive integer"),
        (dict(max_seq_len=0), r"model\.max_seq_len=0 must be a positive integer"),
        (dict(norm_eps=0.0), r"model\.norm_eps=0\.0 must be > 0"),
        (dict(rope_theta=-1.0), r"model\.rope_theta=-1\.0 must be > 0"),
        (dict(ffn_dim_multiplier=0.0), r"model\.ffn_dim_multiplier=0\.0 must be > 0"),
        (dict(dim=250), r"model\.dim=250 must be divisible by model\.n_heads=16"),
        (dict(dim=48), r"model\.dim=48 / model\.n_heads=16 = 3 must be even"),
        (dict(n_heads=12, n_kv_heads=8), r"model\.n_heads=12 must be a multiple of model\.n_kv_heads=8"),
        (dict(vocab_size=0), r"model\.vocab_size=0 must be a positive integer"),
    ],
)
def test_args_validation_names_the_field(kwargs, message):
    with pytest.raises(ValueError, match=message):
        Llama3Args(**kwargs)


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(factor=0.0), r"model\.rope_scaling\.factor=0\.0 must be > 0"),
        (dict(low_freq_factor=4.0), r"model\.rope_scaling\.low_freq_factor=4\.0 must be > 0 and < .*=4\.0"),
        (dict(original_max_position_embeddings=0), r"model\.rope_scaling\.original_max_position_embeddings=0 must be"),
    ],
)
def test_rope_scaling_validation_names_the_field(kwargs, message):
    with pytest.raises(ValueError, match=message):
        RopeScaling(**kwargs)


# -- Hugging Face checkpoints (logits against transformers: test_llama3_hf_parity.py) ----------


def _hf_small_model(seed: int = 0):
    from titan_lightning.models.llama3 import Llama3Args, Transformer

    model = Transformer(Llama3Args(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=128, multiple_of=64,
                                   max_seq_len=32))
    model.init_weights(seed)
    return model


def test_hf_adapter_round_trip_through_sharded_safetensors(tmp_path):
    from titan_lightning.models.llama3 import Llama3StateDictAdapter

    model = _hf_small_model()
    adapter = Llama3StateDictAdapter(model.args)
    hf = adapter.to_hf(model.state_dict())
    assert {"model.embed_tokens.weight", "lm_head.weight", "model.layers.1.self_attn.k_proj.weight",
            "model.layers.1.mlp.down_proj.weight"} <= hf.keys()
    adapter.save_from(model, tmp_path, max_shard_bytes=50_000)
    assert len(list(tmp_path.glob("*.safetensors"))) > 1 and (tmp_path / "model.safetensors.index.json").is_file()
    other = _hf_small_model(seed=7)
    adapter.load_into(other, tmp_path)
    assert all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), other.state_dict().values()))


def test_hf_adapter_names_unknown_keys():
    from titan_lightning.models.llama3 import Llama3StateDictAdapter

    model = _hf_small_model()
    adapter = Llama3StateDictAdapter(model.args)
    with pytest.raises(ValueError, match=r"no Llama name for Hugging Face keys model.layers.0.self_attn.q_norm.weight"):
        adapter.from_hf({"model.layers.0.self_attn.q_norm.weight": torch.ones(16)})
