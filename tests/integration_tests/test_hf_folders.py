"""A Hugging Face folder as a user holds it (saved by transformers, with its tokenizer) trains
with the one command on 2 gloo ranks, and the export loads in transformers as it is: its
logits equal our model's from the same export (fp32), it holds the trained weights, and its
tokenizer encodes as the folder's."""

import pytest
import torch
from safetensors.torch import load_file

from titan_lightning.testing.launch import launch
from titan_lightning.trainer import RUN_DIR_ENV

from tests.hf_folders import VOCAB, assert_transformers_agrees, load_ours, save_hf_folder

transformers = pytest.importorskip("transformers", reason="the reference implementation; a test-only extra")

pytestmark = pytest.mark.multi_process

LAYOUTS = {"fsdp2": ["--job.parallelism.dp_shard", "2"], "tp2": ["--job.parallelism.dp_shard", "1", "--job.parallelism.tp", "2"]}


def _tensors(folder) -> dict[str, torch.Tensor]:
    return {k: v for file in sorted(folder.glob("*.safetensors")) for k, v in load_file(str(file)).items()}


# DeepSeek V3 with the fields a default config leaves out: latent norms at 1e-6 while the others
# are not, and group-limited routing (2 groups of 4 experts, tokens from the best one).
DEEPSEEK_FIELDS = {"rms_norm_eps": 1e-5, "n_group": 2, "topk_group": 1}


@pytest.mark.parametrize("model_type, tie, layout, fields", [
    ("llama", True, "fsdp2", {}), ("llama", False, "tp2", {}), ("qwen3", True, "fsdp2", {}), ("qwen3", False, "tp2", {}),
    ("qwen3_moe", False, "fsdp2", {}), ("qwen3_moe", False, "tp2", {}), ("deepseek_v3", False, "fsdp2", {}),
    ("deepseek_v3", False, "tp2", DEEPSEEK_FIELDS), ("qwen2", True, "fsdp2", {}), ("mistral", False, "tp2", {}),
    ("gpt_oss", False, "fsdp2", {}),
    ("gemma3_text", True, "tp2", {}),
    ("olmo2", False, "tp2", {}),
])
def test_folder_to_one_command_to_transformers(tmp_path, model_type, tie, layout, fields):
    folder = save_hf_folder(tmp_path / "hf", model_type, tie=tie, **fields)
    argv = ["fit", "--recipe", "recipes.hf:pretrained", "--job.checkpoint.initial_load_path", str(folder),
            "--trainer.accelerator", "cpu", "--trainer.devices", "2", "--trainer.max_steps", "2",
            "--job.optimizer.lr", "1e-3", "--job.lr_schedule.warmup_steps", "0", "--trainer.limit_val_batches", "1",
            *LAYOUTS[layout]]
    launch(argv, 2, out_dir=tmp_path / "logs", timeout=300, env={RUN_DIR_ENV: str(tmp_path / "run")})
    export = tmp_path / "run" / "export_hf"
    tokens = torch.randint(0, VOCAB, (2, 32), generator=torch.Generator().manual_seed(0))
    theirs = assert_transformers_agrees(export, load_ours(export), tokens, rtol=0, atol=1e-5)
    assert theirs.config.model_type == model_type and not theirs.config.tie_word_embeddings

    trained, initial = _tensors(export), _tensors(folder)
    assert initial.keys() <= trained.keys()
    assert max((trained[k] - initial[k]).abs().max().item() for k in initial) > 1e-4  # it trained
    if tie:  # the copy of the embeddings became an output of its own
        assert "lm_head.weight" in trained and "lm_head.weight" not in initial

    # The folder's tokenizer, as transformers loads it from either (for qwen2 it is Qwen2Tokenizer,
    # which applies Qwen's own pre-tokenizer to the tiny test tokenizer, in the folder as in the export).
    assert (export / "tokenizer.json").read_bytes() == (folder / "tokenizer.json").read_bytes()
    text = "def add(a, b):\n    return a + b"
    tokenizer, source = transformers.AutoTokenizer.from_pretrained(export), transformers.AutoTokenizer.from_pretrained(folder)
    assert tokenizer.encode(text, add_special_tokens=False) == source.encode(text, add_special_tokens=False)
    assert tokenizer.eos_token == source.eos_token


@pytest.mark.parametrize("model_type, tie, world, degrees", [
    ("llama", True, 4, ["--job.parallelism.dp_shard", "2", "--job.parallelism.tp", "2"]),
    ("qwen3_moe", False, 2, ["--job.parallelism.dp_shard", "2", "--job.parallelism.ep", "2"]),
    ("gpt_oss", False, 2, ["--job.parallelism.dp_shard", "2", "--job.parallelism.ep", "2"]),
    ("phi3", True, 2, ["--job.parallelism.dp_shard", "1", "--job.parallelism.tp", "2"]),
], ids=["llama-tied-fsdp2_tp2", "qwen3_moe-fsdp2_ep2", "gpt_oss-fsdp2_ep2", "phi3-tied-tp2"])
def test_a_folder_loads_exactly_on_a_sharded_layout(tmp_path, model_type, tie, world, degrees):
    """Each rank reads only its blocks (Phi-3: its heads' rows of each fused qkv_proj and gate_up_proj);
    with a learning rate of 1e-30 the fp32 weights stay as loaded, so the export (written from every
    rank, Phi-3's parts fused again) holds the folder's tensors bit for bit."""
    folder = save_hf_folder(tmp_path / "hf", model_type, tie=tie)
    argv = ["fit", "--recipe", "recipes.hf:pretrained", "--job.checkpoint.initial_load_path", str(folder),
            "--trainer.accelerator", "cpu", "--trainer.devices", str(world), "--trainer.max_steps", "1",
            "--job.optimizer.lr", "1e-30", "--job.optimizer.weight_decay", "0", "--trainer.limit_val_batches", "0",
            *degrees]
    launch(argv, world, out_dir=tmp_path / "logs", timeout=300, env={RUN_DIR_ENV: str(tmp_path / "run")})
    exported, initial = _tensors(tmp_path / "run" / "export_hf"), _tensors(folder)
    if tie:
        initial["lm_head.weight"] = initial["model.embed_tokens.weight"]
    assert exported.keys() == initial.keys()
    assert all(torch.equal(exported[k], initial[k]) for k in initial), [k for k in initial if not torch.equal(exported[k], initial[k])]
    assert len(list((tmp_path / "run" / "export_hf").glob("model-0000*-of-*.safetensors"))) >= world  # every rank wrote


def test_loading_a_large_checkpoint_keeps_each_rank_near_its_shard(tmp_path):
    """A 1.05 GiB bf16 checkpoint into an fp32 model under FSDP over 4 gloo ranks: each rank's
    resident memory grows by less than half the checkpoint while it loads (benchmarks/hf_memory.py
    has the figures), and the ranks together hold every value."""
    from benchmarks.hf_memory import make_checkpoint
    from titan_lightning.models.common.hf_checkpoint import HFTensors
    from titan_lightning.testing.spawn import run_function

    size = make_checkpoint(tmp_path / "checkpoint", 1.05)
    assert size >= 2**30
    results = run_function("benchmarks.hf_memory:measure", 4, out_dir=tmp_path / "logs", timeout=300,
                           folder=str(tmp_path / "checkpoint"))
    growths = [r["growth"] for r in results]
    assert max(growths) < size / 2, [f"{g / 2**30:.2f} GiB" for g in growths]
    tensors = HFTensors.open(tmp_path / "checkpoint")
    expected = sum(tensors.read(name).double().sum().item() for name in tensors.keys())
    assert results[0]["checksum"] == pytest.approx(expected, rel=1e-9)
