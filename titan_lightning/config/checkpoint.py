"""When a run saves, what it resumes from, what it starts from and what it exports."""

from dataclasses import dataclass
from typing import Literal, Optional

EXPORT_DTYPES = ("float32", "bfloat16")
EXPORT_FORMATS = ("dcp", "hf")


@dataclass(kw_only=True)
class CheckpointConfig:
    """Checkpoints go to ``<run folder>/checkpoints`` while ``trainer.enable_checkpointing`` is on."""

    # Save every N optimizer steps (None: Lightning's ModelCheckpoint default, after validation).
    interval: Optional[int] = None
    # Keep the newest K checkpoints (-1: all of them).
    keep_latest_k: int = -1
    # Write in the background: the tensors are copied to CPU and training goes on while they are written.
    async_save: bool = False
    # Resume training (model, optimizer, LR schedule, step, data position, RNG): a checkpoint
    # folder, or "latest": the newest complete checkpoint of this recipe (runs/<name>/*/checkpoints).
    resume_from: Optional[str] = None
    # Start from these weights (model only): a Hugging Face safetensors folder ("hf"), a
    # model export or checkpoint folder of ours ("dcp").
    initial_load_path: Optional[str] = None
    initial_load_format: Literal["dcp", "hf"] = "dcp"
    # Before launch, check the crc32 of every file of the checkpoint to resume or start from
    # (recorded when it was saved): a flipped bit is named instead of loaded. Off: sizes only
    # (reading a 1 TB checkpoint once takes minutes; benchmarks/RESULTS.md has the speed).
    verify_checksums: bool = True
    # At the end of fit, export the weights only (no optimizer) to <run folder>/export, in this
    # format and dtype: "dcp" (sharded, loads on any layout) or "hf" (safetensors + index).
    export_format: Optional[Literal["dcp", "hf"]] = None
    export_dtype: Literal["float32", "bfloat16"] = "float32"

    def __post_init__(self) -> None:
        if self.interval is not None and (not isinstance(self.interval, int) or self.interval < 1):
            raise ValueError(f"checkpoint.interval={self.interval!r} must be an integer >= 1, or None")
        if not isinstance(self.keep_latest_k, int) or (self.keep_latest_k < 1 and self.keep_latest_k != -1):
            raise ValueError(f"checkpoint.keep_latest_k={self.keep_latest_k!r} must be -1 (keep all) or >= 1")
        if not isinstance(self.verify_checksums, bool):
            raise ValueError(f"checkpoint.verify_checksums={self.verify_checksums!r} must be true or false")
        if self.initial_load_format not in EXPORT_FORMATS:
            raise ValueError(f"checkpoint.initial_load_format={self.initial_load_format!r} is not one of dcp, hf")
        if self.export_format is not None and self.export_format not in EXPORT_FORMATS:
            raise ValueError(f"checkpoint.export_format={self.export_format!r} is not one of dcp, hf, or None")
        if self.export_dtype not in EXPORT_DTYPES:
            raise ValueError(f"checkpoint.export_dtype={self.export_dtype!r} is not one of float32, bfloat16")
