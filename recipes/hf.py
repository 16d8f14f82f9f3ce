"""Runs of Hugging Face model folders (config.json, safetensors, tokenizer files):

    titan-lightning fit --recipe recipes.hf:pretrained --job.checkpoint.initial_load_path DIR

trains the model in DIR (Llama, Qwen 3, Qwen 3 MoE, DeepSeek V3) from its weights with its
tokenizer, and exports a folder ``from_pretrained`` loads (runs/hf_pretrained/<time>/export).

    titan-lightning prepare --chat --input chats.jsonl --tokenizer DIR --output data/sft
    titan-lightning fit --recipe recipes.hf:sft --job.checkpoint.initial_load_path DIR --job.data.dataset_path data/sft

fine-tunes it on chat or instruction data (README "Fine-tuning").
"""

from titan_lightning.pretrained import pretrained_run, sft_run
from titan_lightning.recipe import Run


def pretrained(initial_load_path: str) -> Run:
    """The model of the Hugging Face folder ``initial_load_path``, fine-tuned on the shipped corpus
    (override as usual: --job.data.dataset_path, --trainer.max_steps ...)."""
    return pretrained_run(initial_load_path)


def sft(initial_load_path: str, dataset_path: str) -> Run:
    """Supervised fine-tuning of the model in ``initial_load_path`` on the SFT shard set
    ``dataset_path`` (``titan-lightning prepare --chat``): loss on the assistant's turns only,
    conversations packed with document masking, fine-tuning defaults (titan_lightning.pretrained.sft_run)."""
    return sft_run(initial_load_path, dataset_path)
