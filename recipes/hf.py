"""Runs of Hugging Face model folders (config.json, safetensors, tokenizer files):

    titan-lightning fit --recipe recipes.hf:pretrained --job.checkpoint.initial_load_path DIR

trains the model in DIR (Llama, Qwen 3, Qwen 3 MoE, DeepSeek V3) from its weights with its
tokenizer, and exports a folder ``from_pretrained`` loads (runs/hf_pretrained/<time>/export).
"""

from titan_lightning.pretrained import pretrained_run
from titan_lightning.recipe import Run


def pretrained(initial_load_path: str) -> Run:
    """The model of the Hugging Face folder ``initial_load_path``, fine-tuned on the shipped corpus
    (override as usual: --job.data.dataset_path, --trainer.max_steps ...)."""
    return pretrained_run(initial_load_path)
