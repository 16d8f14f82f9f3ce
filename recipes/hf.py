"""Runs of Hugging Face model folders (config.json, safetensors, tokenizer files):

    titan-lightning fit --recipe recipes.hf:pretrained --job.checkpoint.initial_load_path DIR

trains the model in DIR (Llama, Qwen 3, Qwen 3 MoE, DeepSeek V3) from its weights with its
tokenizer, and exports a folder ``from_pretrained`` loads (runs/hf_pretrained/<time>/export).

    titan-lightning prepare --chat --input chats.jsonl --tokenizer DIR --output data/sft
    titan-lightning fit --recipe recipes.hf:sft --job.checkpoint.initial_load_path DIR --job.data.dataset_path data/sft

fine-tunes it on chat or instruction data (README "Fine-tuning"). On a GPU both choose their
precision, compilation, attention kernel and sizes for the device (titan_lightning/device_defaults.py);
any field given explicitly is kept.
"""

from dataclasses import replace

from titan_lightning.config import CheckpointConfig, DataConfig, LRScheduleConfig, OptimizerConfig, TrainingConfig
from titan_lightning.device_defaults import for_device
from titan_lightning.estimate import estimate
from titan_lightning.pretrained import read_hf_model
from titan_lightning.recipe import Run, family_run


def pretrained(initial_load_path: str) -> Run:
    """The model of the Hugging Face folder ``initial_load_path``, fine-tuned on the shipped corpus
    (override as usual: --job.data.dataset_path, --trainer.max_steps ...): its args, its tokenizer
    (when it has tokenizer.json), its weights; sequences of min(2048, max_position_embeddings)
    tokens, lr 2e-5 after 10 warmup steps, 1000 steps; an hf export at the end."""
    model = read_hf_model(initial_load_path)
    folder = model.folder
    seq_len = min(2048, model.args.max_seq_len)
    return for_device(family_run(
        model.job_class, model.module_class, model.args,
        training=TrainingConfig(seq_len=seq_len, tokens_per_microbatch_per_dp_rank=seq_len),
        optimizer=OptimizerConfig(lr=2e-5), lr_schedule=LRScheduleConfig(warmup_steps=10),
        data=DataConfig(tokenizer_path=str(folder) if (folder / "tokenizer.json").is_file() else None),
        checkpoint=CheckpointConfig(initial_load_path=str(folder), initial_load_format="hf", export_format="hf"),
    ), estimate)


def sft(initial_load_path: str, dataset_path: str) -> Run:
    """Supervised fine-tuning of the model in ``initial_load_path`` on the chat or instruction shard
    set ``dataset_path`` (``titan-lightning prepare --chat`` with the folder's tokenizer): the loss on
    what the assistant says only, conversations packed whole into windows of min(2048,
    max_position_embeddings) tokens, each attending only to itself (``block_causal``, RoPE positions
    per conversation); lr 2e-5 after 20 warmup steps, cosine decay to 10%; weight decay 0.01, none on
    norms and biases; 1000 steps; an hf export at the end, with the folder's chat template and
    generation settings (README "Fine-tuning")."""
    model = read_hf_model(initial_load_path)
    folder = model.folder
    seq_len = min(2048, model.args.max_seq_len)
    return for_device(family_run(
        model.job_class, model.module_class, replace(model.args, mask="block_causal", positions="per_document"),
        training=TrainingConfig(seq_len=seq_len, tokens_per_microbatch_per_dp_rank=seq_len),
        optimizer=OptimizerConfig(lr=2e-5, weight_decay=0.01, decay_norms_and_biases=False),
        lr_schedule=LRScheduleConfig(warmup_steps=20, decay_type="cosine", min_lr_factor=0.1),
        data=DataConfig(dataset_path=dataset_path, sft=True,
                        tokenizer_path=str(folder) if (folder / "tokenizer.json").is_file() else None),
        checkpoint=CheckpointConfig(initial_load_path=str(folder), initial_load_format="hf", export_format="hf"),
    ), estimate)
