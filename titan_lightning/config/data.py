"""Where tokens come from."""

from dataclasses import dataclass, field
from typing import Optional

SFT_PACKINGS = ("packed", "best_fit", "padded")


@dataclass(kw_only=True)
class DataSource:
    """One source of a mixture: a token shard folder (or a text file) and its weight."""

    path: str
    weight: float = 1.0
    # The name its token count is logged under (data/tokens/<name>); default: the folder's name.
    name: Optional[str] = None


@dataclass(kw_only=True)
class DataConfig:
    # A UTF-8 text file, or a token shard folder written by `titan-lightning prepare`; None is
    # the corpus shipped in titan_lightning/assets/corpus.
    dataset_path: Optional[str] = None
    # A `tokenizers` JSON file; None is the tokenizer shipped in titan_lightning/assets/tokenizer.
    tokenizer_path: Optional[str] = None
    # Share of the corpus held out for validation: the shortest tail of whole documents (whole
    # conversations of SFT data) holding that share of its tokens, split off before packing, the
    # same on every run. 0: nothing held out, no validation.
    val_fraction: float = 0.05
    # A corpus of its own to validate on (a shard set, or a text file), instead of a share of
    # dataset_path: dataset_path then trains whole.
    val_dataset_path: Optional[str] = None
    num_workers: int = 0
    # Repeat the training tokens until one window of seq_len + 1 fits: long-context dry
    # runs and benchmarks on a corpus shorter than one sequence (the shipped one is 128k tokens).
    repeat_to_fit: bool = False
    # A weighted mixture instead of dataset_path (titan_lightning/data/mixture.py), e.g.
    # --job.data.sources '[{"path": "web/", "weight": 3}, {"path": "code/", "weight": 1}]'.
    sources: list[DataSource] = field(default_factory=list)
    # Train on the loss mask of an SFT shard set (`titan-lightning prepare --chat`,
    # titan_lightning/data/sft.py): only the supervised tokens (the assistant's) are targets.
    sft: bool = False
    # "best_fit": whole conversations packed into each window best-fit decreasing within groups of
    # 4096 consecutive conversations (needs model.mask="block_causal", model.positions="per_document");
    # "packed": the same packed next-fit in corpus order (more padding); "padded": one conversation
    # per sample, the batch cut to its longest conversation.
    sft_packing: str = "best_fit"

    def __post_init__(self) -> None:
        if not 0.0 <= self.val_fraction < 1.0:
            raise ValueError(f"data.val_fraction={self.val_fraction} must be in [0, 1) (0: no validation)")
        if self.val_dataset_path is not None and self.sources:
            raise ValueError(f"data.val_dataset_path={self.val_dataset_path!r} with data.sources: each source holds "
                             f"out its data.val_fraction; use one or the other")
        if self.sft_packing not in SFT_PACKINGS:
            raise ValueError(f"data.sft_packing={self.sft_packing!r} is not one of {', '.join(SFT_PACKINGS)}")
        if self.num_workers < 0:
            raise ValueError(f"data.num_workers={self.num_workers} must be >= 0")
        for i, source in enumerate(self.sources):
            if isinstance(source, dict):
                self.sources[i] = source = DataSource(**source)
            if not isinstance(source.weight, (int, float)) or not source.weight > 0:
                raise ValueError(f"data.sources[{i}].weight={source.weight!r} ({source.path}) must be > 0")
        names = self.source_names()
        if len(set(names)) != len(names):
            raise ValueError(f"data.sources name the sources {names}; give each a distinct name")
        if self.sources and self.dataset_path is not None:
            raise ValueError(f"data.sources and data.dataset_path={self.dataset_path!r} are both set; use one")

    def source_names(self) -> list[str]:
        return [s.name or s.path.rstrip("/").rsplit("/", 1)[-1] for s in self.sources]
