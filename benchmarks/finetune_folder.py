"""A Hugging Face model folder and a chat data set of a real model's shape, for the fine-tuning rows of
benchmarks/throughput.py (``*_sft_*`` workloads with a ``folder``): what a fine-tuner starts from.

    python -m benchmarks.finetune_folder qwen2_5_1_5b                 # /tmp/titan_ft_bench/qwen2_5_1_5b/{model,data}
    python -m benchmarks.finetune_folder llama3_8b --layers 16

The folder: config.json of the shape (Qwen 2.5 1.5B: 28 layers, hidden 1536, 12 heads / 2 KV heads,
tied embeddings; Llama 3 8B: 32 layers, 4096, 32 / 8, untied), random bf16 safetensors saved by
transformers, a byte-level BPE tokenizer trained on the shipped corpus with ChatML's special tokens and
a Qwen 2.5-style ChatML chat template (no generation markers: the supervised span comes from the
generation prompt). The data: 3,000 conversations (a system turn, then 1-4 user / assistant pairs of
lognormal lengths, ~1,300 tokens each), ``chats.jsonl``, prepared with ``titan-lightning prepare --chat``
into ``data/``. Random weights train and time as real ones do; the numbers are speed, not quality.
"""

import argparse
import json
import os
import random
import subprocess
import sys
from pathlib import Path

ROOT_ENV = "TITAN_FT_BENCH"
DEFAULT_ROOT = "/tmp/titan_ft_bench"

CHATML = ("{% for message in messages %}{{'<|im_start|>' + message['role'] + '\\n' + message['content'] + "
          "'<|im_end|>' + '\\n'}}{% endfor %}{% if add_generation_prompt %}{{'<|im_start|>assistant\\n'}}{% endif %}")
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]

# transformers config fields of each shape (layers overridable).
SHAPES = {
    "qwen2_5_1_5b": ("qwen2", dict(vocab_size=151936, hidden_size=1536, intermediate_size=8960, num_hidden_layers=28,
                                   num_attention_heads=12, num_key_value_heads=2, max_position_embeddings=32768,
                                   rms_norm_eps=1e-6, tie_word_embeddings=True,
                                   rope_parameters={"rope_type": "default", "rope_theta": 1000000.0})),
    "llama3_8b": ("llama", dict(vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                                num_attention_heads=32, num_key_value_heads=8, max_position_embeddings=131072,
                                rms_norm_eps=1e-5, tie_word_embeddings=False,
                                rope_parameters={"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0,
                                                 "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                                 "original_max_position_embeddings": 8192})),
    # A CPU-sized Qwen 2.5 for checking the fine-tuning contenders run (numbers mean nothing).
    "tiny": ("qwen2", dict(vocab_size=8192, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                           num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=8192,
                           rms_norm_eps=1e-6, tie_word_embeddings=True,
                           rope_parameters={"rope_type": "default", "rope_theta": 1000000.0})),
}


def folders(shape: str, layers=None, root=None) -> tuple[Path, Path]:
    """(model folder, prepared data folder) of ``shape``."""
    base = Path(root or os.environ.get(ROOT_ENV, DEFAULT_ROOT)) / (shape if layers is None else f"{shape}_{layers}l")
    return base / "model", base / "data"


def write_model(folder: Path, shape: str, layers=None) -> None:
    import torch
    import transformers

    model_type, fields = SHAPES[shape]
    fields = dict(fields, **({} if layers is None else {"num_hidden_layers": layers}))
    config = transformers.AutoConfig.for_model(model_type, **fields)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    torch.manual_seed(0)
    with torch.device(device):
        model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    model.save_pretrained(folder)
    del model


def write_tokenizer(folder: Path) -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    from titan_lightning.data.tokenizer import reference_documents

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=8192, special_tokens=SPECIALS, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tokenizer.train_from_iterator(reference_documents(), trainer=trainer)
    tokenizer.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "eos_token": "<|im_end|>", "pad_token": "<|endoftext|>",
        "model_max_length": 32768, "chat_template": CHATML}))
    (folder / "generation_config.json").write_text(json.dumps({"eos_token_id": [tokenizer.token_to_id("<|im_end|>")]}))


def write_chats(path: Path, n: int = 3000, seed: int = 0) -> None:
    """``n`` conversations of words from the shipped corpus, lognormal turn lengths (in words)."""
    from titan_lightning.data.tokenizer import reference_documents

    words = " ".join(reference_documents()).split()
    rng = random.Random(seed)

    def text(mean: float) -> str:
        count = max(3, min(2500, int(rng.lognormvariate(0, 0.8) * mean)))
        start = rng.randrange(len(words) - count)
        return " ".join(words[start:start + count])

    with open(path, "w") as out:
        for _ in range(n):
            messages = [{"role": "system", "content": text(10)}]
            for _ in range(rng.randint(1, 4)):
                messages += [{"role": "user", "content": text(80)}, {"role": "assistant", "content": text(200)}]
            out.write(json.dumps({"messages": messages}) + "\n")


def make(shape: str, layers=None, root=None) -> tuple[Path, Path]:
    """The folder and the prepared data of ``shape`` (made once; later calls find them)."""
    model, data = folders(shape, layers, root)
    if not (model / "config.json").is_file():
        model.mkdir(parents=True, exist_ok=True)
        write_model(model, shape, layers)
        write_tokenizer(model)
    if not (data / "index.json").is_file():
        chats = data.parent / "chats.jsonl"
        write_chats(chats)
        subprocess.run([sys.executable, "-m", "titan_lightning.cli", "prepare", "--chat", "--input", str(chats),
                        "--tokenizer", str(model), "--output", str(data), "--max-tokens", "8192"], check=True)
    return model, data


def main(make_folders=make, doc: str = __doc__) -> None:
    """The command line of ``make_folders`` (this one's, or benchmarks/preference_pairs.py's)."""
    parser = argparse.ArgumentParser(description=doc.split("\n\n")[0])
    parser.add_argument("shape", choices=sorted(SHAPES))
    parser.add_argument("--layers", type=int, default=None)
    parser.add_argument("--root", default=None)
    args = parser.parse_args()
    print(*make_folders(args.shape, args.layers, args.root))


if __name__ == "__main__":
    main()
