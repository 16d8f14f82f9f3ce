"""Fine-tuning as the README walks a newcomer through it: a Hugging Face folder (Qwen 3, ChatML
chat template, sampling settings in generation_config.json), chat JSONL prepared with the folder's
own template (a loss mask on the assistant's turns), ``recipes.hf:sft`` on 2 gloo ranks, and the
export loaded by transformers: the same logits as our model from it, the trained weights, the
folder's chat template and generation settings."""

import json
import random
import shutil
from pathlib import Path

import pytest
import torch

from titan_lightning.recipe import RUN_DIR_ENV
from titan_lightning.testing.launch import launch

from tests.hf_folders import VOCAB, save_hf_folder

transformers = pytest.importorskip("transformers", reason="the reference implementation; a test-only extra")

pytestmark = pytest.mark.multi_process

TEMPLATE = Path(__file__).parents[1] / "assets" / "chat_templates" / "qwen3.jinja"
GENERATION = {"do_sample": True, "temperature": 0.7, "top_p": 0.8, "top_k": 20}


def _chat_folder(folder: Path) -> Path:
    """A Qwen 3 folder as an instruct checkpoint ships: ChatML special tokens, chat_template.jinja,
    sampling settings and the end-of-turn id among the EOS ids of generation_config.json."""
    from tokenizers import AddedToken, Tokenizer

    save_hf_folder(folder, "qwen3")
    tokenizer = Tokenizer.from_file(str(folder / "tokenizer.json"))
    tokenizer.add_special_tokens([AddedToken(t, special=True) for t in ("<|im_start|>", "<|im_end|>")])
    tokenizer.save(str(folder / "tokenizer.json"))
    shutil.copy(TEMPLATE, folder / "chat_template.jinja")
    eos = [tokenizer.token_to_id("<|im_end|>"), tokenizer.token_to_id("<|endoftext|>")]
    (folder / "generation_config.json").write_text(json.dumps({**GENERATION, "eos_token_id": eos}))
    return folder


def _conversations(path: Path, n: int = 48) -> Path:
    words = "the model learns to answer short questions about numbers and colors with one word".split()
    rng = random.Random(0)
    with path.open("w") as f:
        for i in range(n):
            turns = [{"role": "system", "content": "Be brief."}] if i % 2 else []
            for _ in range(1 + i % 2):
                turns += [{"role": "user", "content": " ".join(rng.choices(words, k=4)) + "?"},
                          {"role": "assistant", "content": " ".join(rng.choices(words, k=3)) + "."}]
            f.write(json.dumps({"messages": turns}) + "\n")
    return path


def test_prepare_fit_export_and_transformers_loads_it(tmp_path, capsys):
    from titan_lightning.cli import main

    folder = _chat_folder(tmp_path / "hf")
    data = tmp_path / "sft"
    assert main(["prepare", "--chat", "--input", str(_conversations(tmp_path / "chats.jsonl")), "--tokenizer",
                 str(folder), "--output", str(data), "--max-tokens", "65", "--too-long", "truncate",
                 "--no-progress"]) == 0
    index = json.loads((data / "index.json").read_text())
    assert index["loss_mask"] and index["sft"]["conversations"] == 48

    argv = ["fit", "--recipe", "recipes.hf:sft", "--job.checkpoint.initial_load_path", str(folder),
            "--job.data.dataset_path", str(data), "--trainer.accelerator", "cpu", "--trainer.devices", "2",
            "--job.parallelism.dp_shard", "2", "--trainer.max_steps", "3", "--job.optimizer.lr", "1e-3",
            "--job.lr_schedule.warmup_steps", "0", "--trainer.limit_val_batches", "1"]
    ranks = launch(argv, 2, out_dir=tmp_path / "logs", timeout=300, env={RUN_DIR_ENV: str(tmp_path / "run")}).ranks
    assert all(len(rank["losses"]) == 3 for rank in ranks)

    export = tmp_path / "run" / "export_hf"
    theirs = transformers.AutoModelForCausalLM.from_pretrained(export, dtype=torch.float32).eval()
    from titan_lightning.models.common.decoder import decoder_class
    from titan_lightning.pretrained import read_hf_model

    model = read_hf_model(export)
    ours = decoder_class(type(model.args))(model.args)
    model.module_class.hf_adapter(model.args).load_into(ours, export)
    tokens = torch.randint(0, VOCAB, (2, 32), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(ours(tokens), theirs(tokens).logits, rtol=0, atol=1e-5)
    initial = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    assert (theirs.model.layers[0].mlp.down_proj.weight - initial.model.layers[0].mlp.down_proj.weight).abs().max() > 1e-4

    tokenizer = transformers.AutoTokenizer.from_pretrained(export)
    assert tokenizer.chat_template == TEMPLATE.read_text()
    chat = [{"role": "user", "content": "colors?"}]
    assert tokenizer.apply_chat_template(chat, tokenize=False, add_generation_prompt=True) == \
        transformers.AutoTokenizer.from_pretrained(folder).apply_chat_template(chat, tokenize=False,
                                                                               add_generation_prompt=True)
    generation = transformers.GenerationConfig.from_pretrained(export)
    for key, value in GENERATION.items():
        assert getattr(generation, key) == value, key
    assert tokenizer.convert_tokens_to_ids("<|im_end|>") in generation.eos_token_id
