"""Runs of Hugging Face model folders (config.json, safetensors, tokenizer files):

    titan-lightning fit --recipe recipes.hf:pretrained --job.checkpoint.initial_load_path DIR

trains the model in DIR (Llama, Qwen 3, Qwen 3 MoE, DeepSeek V3) from its weights with its
tokenizer, and exports a folder ``from_pretrained`` loads (runs/hf_pretrained/<time>/export).

    titan-lightning prepare --chat --input chats.jsonl --tokenizer DIR --output data/sft
    titan-lightning fit --recipe recipes.hf:sft --job.checkpoint.initial_load_path DIR --job.data.dataset_path data/sft

fine-tunes it on chat or instruction data (README "Fine-tuning"); ``recipes.hf:lora`` / ``qlora`` with
adapters (README "LoRA"); ``recipes.hf:dpo`` / ``dpo_lora`` on preference pairs (``prepare --preference``;
README "Preference training"). On a GPU each chooses its precision, compilation, attention kernel
and sizes for the device (titan_lightning/device_defaults.py); any field given explicitly is kept.
"""

import json
from dataclasses import replace
from pathlib import Path

from titan_lightning.config import CheckpointConfig, DataConfig, LRScheduleConfig, OptimizerConfig, TrainingConfig
from titan_lightning.config.lora import ALL_LINEAR, LoRAConfig
from titan_lightning.config.preference import PreferenceConfig
from titan_lightning.data.shards import INDEX
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
    run = family_run(
        model.job_class, model.module_class, model.args,
        training=TrainingConfig(seq_len=seq_len, tokens_per_microbatch_per_dp_rank=seq_len),
        optimizer=OptimizerConfig(lr=2e-5), lr_schedule=LRScheduleConfig(warmup_steps=10),
        data=DataConfig(tokenizer_path=str(folder) if (folder / "tokenizer.json").is_file() else None),
        checkpoint=CheckpointConfig(initial_load_path=str(folder), initial_load_format="hf", export_format="hf"),
    )
    run.module.hf_model = model  # the folder as read: the pre-launch check and the load read it no more
    return for_device(run, estimate)


# Passes over the conversations of recipes.hf:sft, as TRL's SFTTrainer (num_train_epochs=3) and
# the Alpaca and Vicuna fine-tunes: a small instruction set needs several; the held-out loss,
# validated through the run, shows when a set overfits (--trainer.max_epochs 1 for a large one).
SFT_EPOCHS = 3
# The held-out share of recipes.hf:sft (data.val_fraction: the tail of whole conversations holding
# 5% of the tokens, at least one), none for a set of fewer than SFT_VAL_MIN_CONVERSATIONS.
SFT_VAL_FRACTION, SFT_VAL_MIN_CONVERSATIONS = 0.05, 20


def sft(initial_load_path: str, dataset_path: str) -> Run:
    """Supervised fine-tuning of the model in ``initial_load_path`` on the chat or instruction shard
    set ``dataset_path`` (``titan-lightning prepare --chat`` with the folder's tokenizer): the loss on
    what the assistant says only, conversations packed whole into windows of min(2048,
    max_position_embeddings) tokens, each attending only to itself (``block_causal``, RoPE positions
    per conversation); 3 epochs (SFT_EPOCHS), the steps derived from the data; lr 2e-5 after a
    warmup of 3% of the steps, cosine decay to 10%; weight decay 0.01, none on norms and biases; 5%
    of the conversations held out and validated 10 times through the run and after its last step
    (none held out from fewer than 20); an hf export at the end, with the folder's chat template and
    generation settings (README "Fine-tuning")."""
    model = read_hf_model(initial_load_path)
    folder = model.folder
    seq_len = min(2048, model.args.max_seq_len)
    run = family_run(
        model.job_class, model.module_class, replace(model.args, mask="block_causal", positions="per_document"),
        training=TrainingConfig(seq_len=seq_len, tokens_per_microbatch_per_dp_rank=seq_len),
        optimizer=OptimizerConfig(lr=2e-5, weight_decay=0.01, decay_norms_and_biases=False),
        lr_schedule=LRScheduleConfig(warmup_steps=0, warmup_ratio=0.03, decay_type="cosine", min_lr_factor=0.1),
        data=DataConfig(dataset_path=dataset_path, sft=True, val_fraction=_sft_val_fraction(dataset_path),
                        tokenizer_path=str(folder) if (folder / "tokenizer.json").is_file() else None),
        checkpoint=CheckpointConfig(initial_load_path=str(folder), initial_load_format="hf", export_format="hf"),
    )
    run.module.hf_model = model  # the folder as read: the pre-launch check and the load read it no more
    run.trainer = {"max_epochs": SFT_EPOCHS}  # the data module derives max_steps from the data's size
    return for_device(run, estimate)


def lora(initial_load_path: str, dataset_path: str) -> Run:
    """``sft`` with LoRA adapters, as PEFT and TRL fine-tune by default: rank 16, alpha 32 on every
    linear layer but the head (``all-linear``), no dropout, lr 2e-4; the base frozen in the compute
    dtype (bf16 on a GPU), its checkpoints the adapters alone; the hf export writes the merged model,
    and the adapters as PEFT's folder in export_hf/adapter (README "LoRA")."""
    run = sft(initial_load_path, dataset_path)
    run.job.lora = LoRAConfig(rank=16, alpha=32.0, target_modules=[ALL_LINEAR])
    run.job.optimizer.lr = 2e-4
    return run


def qlora(initial_load_path: str, dataset_path: str) -> Run:
    """``lora`` on a base stored as NF4 (QLoRA: torchao's 4-bit NormalFloat, dequantized per forward):
    the adapted linears' frozen weights in about a quarter of bf16's memory; one process or FSDP2 / HSDP."""
    run = lora(initial_load_path, dataset_path)
    run.job.lora.quantize_base = "nf4"
    return run


def dpo(initial_load_path: str, dataset_path: str) -> Run:
    """Preference training (DPO, TRL's defaults: beta 0.1, the sigmoid loss) of the model in
    ``initial_load_path`` on the pairs ``dataset_path`` (``titan-lightning prepare --preference`` with
    the folder's tokenizer): as ``sft`` (pairs packed whole, 5% held out) but one epoch at lr 5e-7
    after a warmup of 10% of the steps (Zephyr's DPO), the loss averaged over the pairs of each step;
    the reference's log-probabilities computed from the starting weights in one pass before training
    and kept next to the shards (``--job.preference.loss ipo|simpo``, ``--job.preference.beta``:
    README "Preference training")."""
    run = sft(initial_load_path, dataset_path)
    run.job.preference = PreferenceConfig(loss="dpo")
    run.job.optimizer.lr = 5e-7
    run.job.lr_schedule.warmup_ratio = 0.1
    run.trainer = {"max_epochs": 1}
    return run


def dpo_lora(initial_load_path: str, dataset_path: str) -> Run:
    """``dpo`` with ``lora``'s adapters (rank 16, alpha 32, every linear but the head), the reference
    being the base with its adapters switched off, as TRL's DPOTrainer does with a ``peft_config`` and no
    ``ref_model``: one model, no precomputed pass, nothing kept next to the shards; lr 5e-6 (the
    alignment handbook's QLoRA DPO of Zephyr). Checkpoints and exports as ``lora`` (the adapters alone;
    export_hf/adapter is PEFT's folder); ``--job.lora.quantize_base nf4`` makes it QLoRA DPO."""
    run = dpo(initial_load_path, dataset_path)
    run.job.lora = LoRAConfig(rank=16, alpha=32.0, target_modules=[ALL_LINEAR])
    run.job.preference.reference = "adapters_off"
    run.job.optimizer.lr = 5e-6
    return run


def _sft_val_fraction(dataset_path: str) -> float:
    """SFT_VAL_FRACTION, or 0 (nothing held out) for a set of fewer than SFT_VAL_MIN_CONVERSATIONS
    (a folder that is not a shard set is refused before launch, naming data.dataset_path)."""
    try:
        conversations = json.loads((Path(dataset_path) / INDEX).read_text())["documents"]
    except (OSError, ValueError, KeyError, TypeError):
        return SFT_VAL_FRACTION
    return SFT_VAL_FRACTION if conversations >= SFT_VAL_MIN_CONVERSATIONS else 0.0
