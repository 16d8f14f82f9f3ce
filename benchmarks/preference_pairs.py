"""Preference pairs for the fine-tuning folders of benchmarks/finetune_folder.py: the data of DPO's
rows, next to the same model's SFT rows.

    python -m benchmarks.preference_pairs qwen2_5_1_5b     # <root>/qwen2_5_1_5b/{pairs.jsonl, pairs/}
    titan-lightning fit --recipe recipes.hf:dpo --job.checkpoint.initial_load_path <root>/qwen2_5_1_5b/model \\
        --job.data.dataset_path <root>/qwen2_5_1_5b/pairs --trainer.max_epochs -1 --trainer.max_steps 30 \\
        [--job.preference.reference frozen | --job.lora.rank 16 --job.preference.reference adapters_off]

Each conversation of the folder's ``chats.jsonl`` becomes a pair: the prompt is its turns before its
last answer, the chosen answer that answer, the rejected one the last answer of the next conversation
(lognormal lengths: pairs of very uneven lengths). Prepared with ``--preference --max-tokens 1024``, so
that a pair fits the recipe's window of 2,048 tokens.
"""

import json
import subprocess
import sys
from pathlib import Path

from benchmarks.finetune_folder import main, make

MAX_TOKENS = 1024  # per answer: a pair fits recipes.hf:dpo's window of min(2048, max_position_embeddings)


def write_pairs(chats: Path, path: Path) -> None:
    conversations = [json.loads(line)["messages"] for line in chats.read_text().splitlines() if line.strip()]
    with open(path, "w") as out:
        for k, messages in enumerate(conversations):
            other = conversations[(k + 1) % len(conversations)]
            out.write(json.dumps({"prompt": messages[:-1], "chosen": [messages[-1]], "rejected": [other[-1]]}) + "\n")


def make_pairs(shape: str, layers=None, root=None) -> tuple[Path, Path]:
    """(model folder, prepared pairs folder) of ``shape`` (made once; later calls find them)."""
    model, data = make(shape, layers, root)
    pairs = data.parent / "pairs"
    if not (pairs / "index.json").is_file():
        source = data.parent / "pairs.jsonl"
        write_pairs(data.parent / "chats.jsonl", source)
        subprocess.run([sys.executable, "-m", "titan_lightning.cli", "prepare", "--preference", "--input", str(source),
                        "--tokenizer", str(model), "--output", str(pairs), "--max-tokens", str(MAX_TOKENS)], check=True)
    return model, pairs


if __name__ == "__main__":
    main(make_pairs, __doc__)
