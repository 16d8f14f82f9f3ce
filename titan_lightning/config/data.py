"""Where tokens come from."""

from dataclasses import dataclass
from typing import Optional


@dataclass(kw_only=True)
class DataConfig:
    # A UTF-8 text file, or a token shard folder written by `titan-lightning prepare`; None is
    # the corpus shipped in tests/assets/corpus.
    dataset_path: Optional[str] = None
    # A `tokenizers` JSON file; None is the tokenizer shipped in tests/assets/tokenizer.
    tokenizer_path: Optional[str] = None
    # Share of the corpus (its tail) held out for validation.
    val_fraction: float = 0.05
    num_workers: int = 0
    # Repeat the training tokens until one window of seq_len + 1 fits: long-context dry
    # runs and benchmarks on a corpus shorter than one sequence (the shipped one is 128k tokens).
    repeat_to_fit: bool = False

    def __post_init__(self) -> None:
        if not 0.0 < self.val_fraction < 1.0:
            raise ValueError(f"data.val_fraction={self.val_fraction} must be in (0, 1)")
        if self.num_workers < 0:
            raise ValueError(f"data.num_workers={self.num_workers} must be >= 0")
