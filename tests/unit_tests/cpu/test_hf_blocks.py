"""Reading blocks of a Hugging Face checkpoint: every block a rank asks for equals the same block
of the fully converted tensor (RoPE permutation, expert stacking, tied output), for any rows and
columns; a damaged file is one line naming it."""

import json

import pytest
import torch
from safetensors.torch import save_file

from titan_lightning.models.common.hf_checkpoint import HFTensors, save_hf_safetensors
from titan_lightning.models.common.moe import MoEArgs
from titan_lightning.models.qwen3 import Qwen3Args, Qwen3StateDictAdapter, Transformer

ARGS = Qwen3Args(vocab_size=96, dim=32, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=8, ffn_hidden_dim=48,
                 moe=MoEArgs(num_experts=4, top_k=2, hidden_dim=16, load_balance_coeff=None))


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    torch.manual_seed(0)
    model = Transformer(ARGS)
    state = {k: torch.randn(v.shape).to(torch.bfloat16 if "experts" in k else torch.float32)
             for k, v in model.state_dict().items()}
    folder = tmp_path_factory.mktemp("hf")
    adapter = Qwen3StateDictAdapter(ARGS, tie_word_embeddings=True)
    state["output.weight"] = state["tok_embeddings.weight"]
    save_hf_safetensors(adapter.to_hf(state), folder, max_shard_bytes=20_000)  # several files and an index
    return folder


def _blocks(shape, generator):
    """Random blocks of a tensor of ``shape``: rows and (for 2-D and more) columns, empty ones too."""
    for _ in range(6):
        index = []
        for n in shape[:2]:
            a = int(torch.randint(0, n + 1, (), generator=generator))
            b = int(torch.randint(a, n + 1, (), generator=generator))
            index.append(slice(a, b))
        yield tuple(index)


def test_every_block_equals_the_block_of_the_converted_tensor(folder):
    adapter = Qwen3StateDictAdapter(ARGS, tie_word_embeddings=True)
    tensors = HFTensors.open(folder)
    assert len(list(folder.glob("model-*.safetensors"))) > 2
    sources = adapter.sources(tensors)
    full = adapter.from_hf({k: tensors.read(k) for k in tensors.keys()})
    assert sources.keys() == full.keys() and "output.weight" in full
    generator = torch.Generator().manual_seed(0)
    for name, source in sources.items():
        assert source.shape == tuple(full[name].shape), name
        assert torch.equal(source.full(), full[name]), name
        for index in _blocks(source.shape, generator):
            assert torch.equal(source.read(index), full[name][index]), (name, index)


def test_a_block_of_a_permuted_key_reads_only_the_heads_it_spans(folder, monkeypatch):
    tensors = HFTensors.open(folder)
    reads = []
    original = tensors._read
    monkeypatch.setattr(tensors, "_read", lambda name, index: reads.append((name, index)) or original(name, index))
    source = Qwen3StateDictAdapter(ARGS).sources(tensors)["layers.0.attention.wq.weight"]
    source.read((slice(9, 12), slice(0, 32)))  # inside head 1 (rows 8..15)
    assert reads == [("model.layers.0.self_attn.q_proj.weight", (slice(8, 16), slice(0, 32)))]


@pytest.mark.parametrize("damage, message", [
    (lambda b: b[:-3], "the tensors end at byte"),
    (lambda b: b[:5], "shorter than its 8-byte header length"),
    (lambda b: (10**9).to_bytes(8, "little") + b[8:], "header length 1000000000 exceeds the file"),
    (lambda b: b[:8] + b"x" + b[9:], "header is not JSON"),
])
def test_a_damaged_file_is_one_line_naming_it(tmp_path, damage, message):
    save_file({"a": torch.ones(4, 4), "b": torch.zeros(3)}, str(tmp_path / "model.safetensors"))
    path = tmp_path / "model.safetensors"
    path.write_bytes(damage(path.read_bytes()))
    with pytest.raises(ValueError, match=f"^{path}: not a readable safetensors file .*{message}"):
        HFTensors.open(tmp_path)


def test_an_index_that_lists_other_tensors_is_refused(tmp_path):
    save_file({"a": torch.ones(2)}, str(tmp_path / "model-00001-of-00001.safetensors"))
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps(
        {"weight_map": {"a": "model-00001-of-00001.safetensors", "b": "model-00001-of-00001.safetensors"}}))
    with pytest.raises(ValueError, match=r"tensors do not match model.safetensors.index.json: missing \['b'\]"):
        HFTensors.open(tmp_path)
