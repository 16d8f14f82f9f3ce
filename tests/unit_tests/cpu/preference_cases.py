"""Preference training runs of recipes.hf:dpo on a tiny Hugging Face folder and its prepared pairs, on
any number of ranks: each rank returns, per optimizer step, the logged loss, grad norm and metrics.
Run in-process for one rank, and on 2 ranks through titan_lightning.testing.spawn by test_preference.py."""

import json
import os
import shutil
from pathlib import Path

import lightning as L

# Pairs of very uneven lengths: answers of 1 to 10 words, a prompt of 1 to 6 (each word ~2 tokens).
WORDS = "the quick brown fox jumps over a lazy dog while seven small birds sing in the old green tree".split()


def records(count: int) -> list[dict]:
    """``count`` pairs in the formats people publish (text prompts, message prompts, implicit prompts)."""
    out = []
    for k in range(count):
        prompt = " ".join(WORDS[(k * 3 + j) % len(WORDS)] for j in range(1 + (k * 7) % 6)) + "?"
        chosen = " ".join(WORDS[(k + j) % len(WORDS)] for j in range(1 + (k * 11) % 10)) + "."
        rejected = " ".join(WORDS[(k * 5 + j) % len(WORDS)] for j in range(1 + (k * 13 + 5) % 9)) + "!"
        if k % 3 == 0:
            out.append({"prompt": prompt, "chosen": chosen, "rejected": rejected})
        elif k % 3 == 1:
            out.append({"prompt": [{"role": "user", "content": prompt}],
                        "chosen": [{"role": "assistant", "content": chosen}],
                        "rejected": [{"role": "assistant", "content": rejected}]})
        else:
            turn = [{"role": "user", "content": prompt}]
            out.append({"chosen": turn + [{"role": "assistant", "content": chosen}],
                        "rejected": turn + [{"role": "assistant", "content": rejected}]})
    return out


def make_folders(root: Path, positions: int = 256, pairs: int = 16) -> tuple[Path, Path]:
    """A qwen2 folder with a ChatML template, and ``pairs`` pairs prepared with its tokenizer."""
    from tests.hf_folders import save_hf_folder
    from titan_lightning.data.prepare import main as prepare_main

    template = Path(__file__).resolve().parents[2] / "assets" / "chat_templates" / "chatml_generation.jinja"
    folder = save_hf_folder(root / "policy", "qwen2", max_position_embeddings=positions)
    shutil.copy(template, folder / "chat_template.jinja")
    (root / "pairs.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records(pairs)))
    prepare_main(["--preference", "--input", str(root / "pairs.jsonl"), "--tokenizer", str(folder), "--output",
                  str(root / "shards"), "--workers", "1", "--no-progress", "--max-tokens", str(positions // 2)])
    return folder, root / "shards"


class Steps(L.Callback):
    """Each optimizer step's logged values."""

    NAMES = ("train/loss", "train/grad_norm", "train/rewards/chosen", "train/rewards/margins", "train/logps/rejected",
             "train/pairs")

    def __init__(self) -> None:
        self.steps: list[dict] = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if trainer.global_step > len(self.steps):
            self.steps.append({n: trainer.callback_metrics[n].item() for n in self.NAMES})


def dpo_run(rank: int = 0, world_size: int = 1, *, folder: str, data: str, loss: str = "dpo", microbatches: int = 4,
            steps: int = 2, run_dir: str, lora_rank: int = 0, reference: str = "precomputed",
            accelerator: str = "cpu", compiled_bf16: bool = False) -> dict:
    """``steps`` optimizer steps of recipes.hf:dpo (``loss``), one window a microbatch and
    ``microbatches`` windows a step over all ranks (gradient accumulation makes up the rest); a
    quarter of the pairs held out, validated after the last step (``val``: what it logged).
    ``lora_rank``: LoRA adapters on every linear; ``reference``: preference.reference;
    ``compiled_bf16``: bf16-mixed with compiled blocks (as on a GPU)."""
    from recipes.hf import dpo
    from titan_lightning.recipe import check_inputs, execute
    from titan_lightning.trainer import RUN_DIR_ENV, build_trainer

    run = dpo(folder, data)
    job = run.job
    job.preference.loss, job.preference.reference = loss, reference
    if lora_rank:
        from titan_lightning.config.lora import ALL_LINEAR, LoRAConfig

        job.lora = LoRAConfig(rank=lora_rank, alpha=2.0 * lora_rank, target_modules=[ALL_LINEAR])
    job.training.tokens_per_microbatch_per_dp_rank = job.training.seq_len
    job.training.tokens_per_step = job.training.seq_len * microbatches
    # (the sizes as given, on a GPU too: the device's choice would take the step in one microbatch)
    run.explicit = {*run.explicit, "job.training.seq_len", "job.training.tokens_per_microbatch_per_dp_rank"}
    job.training.max_grad_norm = None
    job.lr_schedule.warmup_ratio, job.lr_schedule.warmup_steps = 0.0, 0
    job.optimizer.lr = 1e-3  # a visible first update: step 2 checks it
    job.data.val_fraction = 0.25
    job.checkpoint.export_format = None
    job.compile.enable = compiled_bf16
    recorded = Steps()
    precision = {"precision": "bf16-mixed"} if compiled_bf16 else {}
    run.trainer = dict(accelerator=accelerator, devices=world_size, max_steps=steps, max_epochs=-1, callbacks=[recorded],
                       **precision,
                       enable_progress_bar=False, enable_checkpointing=False, num_sanity_val_steps=0,
                       val_check_interval=steps * microbatches // world_size)  # (in batches: after the last step)
    os.environ[RUN_DIR_ENV] = run_dir
    built = build_trainer(run)
    check_inputs("fit", run, built)
    execute("fit", run, built)
    val = {k: v.item() for k, v in built.callback_metrics.items() if k.startswith("val/")}
    return {"steps": recorded.steps, "val": val}
