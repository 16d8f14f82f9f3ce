"""The LightningDataModule a run trains on: the corpus as next-token windows, resumable."""

import logging
import math
from collections import OrderedDict
from pathlib import Path
from typing import Any, Callable, Optional

import lightning as L
import numpy as np
from torch.utils.data import DataLoader

from titan_lightning.config import JobConfig
from titan_lightning.data.dataset import (
    EpochStream,
    TokenWindows,
    TrainStream,
    ValWindows,
    read_documents,
    split_documents,
    tokenize_documents,
)
from titan_lightning.data.mixture import ConcatWindows, MixtureSchedule, MixtureStream
from titan_lightning.data.pair_windows import PairWindows
from titan_lightning.data.preference import check_pairs
from titan_lightning.data.sft import ConversationWindows, TrimPadding, check_loss_mask, sequence_multiple
from titan_lightning.data.shards import ShardSet, TokenSpan, is_shard_set, tokenizer_identity
from titan_lightning.data.chat import check_supervised
from titan_lightning.data.tokenizer import (CORPUS_PATH, Tokenizer, load_tokenizer, scan_token_ids, shipped_asset,
                                            tokenizer_file)

log = logging.getLogger(__name__)

# What a run by epochs that leaves Lightning's logging and validation defaults gets (``setup``):
# train/* logged every min(50, max(1, steps // 100)) steps, and the held-out set validated
# VALIDATIONS_PER_RUN times evenly through the run and after its last step (FinalValidation).
LIGHTNING_LOG_EVERY_N_STEPS = 50
VALIDATIONS_PER_RUN = 10


class TextDataModule(L.LightningDataModule):
    """Batches ``{"input_ids", "labels", "position_ids"}`` of shape ``[training.microbatch_size,
    training.seq_len]`` (``position_ids``: each token's position in its document, see TokenWindows).

    A run limited by steps (``trainer.max_steps``, ``max_epochs`` unset) trains on an endless
    stream of epochs. A run limited by epochs (``trainer.max_epochs`` N) trains N passes of whole
    optimizer steps (EpochStream: the last partial step of each pass is left out); its loader's
    length is the batches of one pass, and ``setup`` derives ``max_steps`` (N passes, or fewer when
    ``max_steps`` says so) and, where the run leaves Lightning's defaults, how often it logs and
    validates. The val loader is finite. Both are sharded by data-parallel rank, read from the
    Trainer's ``distributed_sampler_kwargs`` (``(1, 0)`` without a Trainer or outside a parallel
    strategy). ``state_dict`` records how many samples this rank has trained on, so a run
    restored from a checkpoint continues at exactly the next sample.

    With ``data.sft`` the corpus is a shard set with loss masks, its samples whole conversations
    (ConversationWindows: labels IGNORE_INDEX on what is not supervised), packed or padded
    (``data.sft_packing``); shuffling, sharding and resuming are the same.
    """

    def __init__(self, job: JobConfig) -> None:
        super().__init__()
        self.job = job
        self._tokenizer: Optional[tuple[Optional[str], Tokenizer]] = None
        self._train: Optional[TokenWindows] = None
        self._val: Optional[TokenWindows] = None
        self._short_split: Optional[str] = None  # why the val split has no window, when it has none
        self._streams: Optional[tuple[tuple, dict[str, np.ndarray]]] = None
        # Samples this rank had consumed when the current train loader was built, and the
        # Trainer that loader serves with its trained-batch count then (None: no Trainer).
        self._start = 0
        self._counter: Optional[tuple[L.Trainer, int]] = None
        self._sources: list[TokenWindows] = []
        self._mixture_base: tuple[int, Optional[list[int]]] = (0, None)
        self._built: Optional[tuple[tuple, TokenWindows]] = None  # the train windows of the streams read
        self._epoch_samples: Optional[int] = None  # a run by epochs: samples of one epoch on this rank

    @property
    def tokenizer(self) -> Tokenizer:
        """The tokenizer ``job.data.tokenizer_path`` names, loaded once per path."""
        path = self.job.data.tokenizer_path
        if self._tokenizer is None or self._tokenizer[0] != path:
            self._tokenizer = (path, load_tokenizer(path))
        return self._tokenizer[1]

    def check_inputs(self, trainer: Optional[L.Trainer] = None) -> None:
        """Before launch: the tokenizer and the corpus load, and the train split fills one window
        (given the ``trainer`` of a run by epochs: one optimizer step on its layout).

        Raises ValueError/FileNotFoundError naming the field; what it reads is kept for setup."""
        self._read()
        if trainer is not None and by_epochs(trainer):
            p = self.job.parallelism
            self.steps_per_epoch(p.dp_replicate * p.resolved_dp_shard(trainer.world_size),
                                 trainer.accumulate_grad_batches, trainer.max_epochs)

    def _read(self) -> dict[str, Any]:
        """The tokenized train and val streams, read once per (corpus, tokenizer, split, seq_len);
        with ``data.sources``, one pair per source (``"sources"``: [streams, ...])."""
        data, seq_len = self.job.data, self.job.training.seq_len
        key = (data.dataset_path, tuple((s.path, s.weight) for s in data.sources), data.tokenizer_path,
               data.val_fraction, data.val_dataset_path, data.repeat_to_fit, seq_len)
        if self._streams is not None and self._streams[0] == key:
            return self._streams[1]
        if data.sources:
            streams = {"sources": [self._read_one(Path(s.path), f"data.sources[{i}].path")
                                   for i, s in enumerate(data.sources)]}
            self._streams = (key, streams)
            return streams
        streams = self._read_one(shipped_asset(CORPUS_PATH) if data.dataset_path is None else Path(data.dataset_path))
        self._streams = (key, streams)
        return streams

    def _read_one(self, path: Path, field: str = "data.dataset_path") -> dict[str, Any]:
        data, seq_len = self.job.data, self.job.training.seq_len
        streams = self._splits(path, field, 0.0 if data.val_dataset_path is not None else data.val_fraction)
        if data.val_dataset_path is not None:
            streams["val"] = self._splits(Path(data.val_dataset_path), "data.val_dataset_path", 0.0)["train"]
            if not self._fills_window(streams["val"]):
                raise ValueError(self._too_short("val", len(streams["val"]), Path(data.val_dataset_path),
                                                 "data.val_dataset_path"))
        if data.repeat_to_fit and 0 < len(streams["train"]) < seq_len + 1:
            train = streams["train"][0:len(streams["train"])]
            streams["train"] = np.tile(train, -(-(seq_len + 1) // len(train)))
        if not self._fills_window(streams["train"]):
            raise ValueError(self._too_short("train", len(streams["train"]), path, field))
        return streams

    def _splits(self, path: Path, field: str, val_fraction: float) -> dict[str, Any]:
        """The train and val streams of one corpus (val None at ``val_fraction`` 0)."""
        data = self.job.data
        if field != "data.dataset_path" and not path.exists():
            raise FileNotFoundError(f"{field}={str(path)!r}: no such file or folder")
        if is_shard_set(path):
            return shard_splits(path, data.tokenizer_path, val_fraction, self.tokenizer, field,
                                vocab_size=self.job.model.vocab_size, sft=data.sft,
                                preference=self.job.preference.loss)
        check_loss_mask(False, data.sft, field, str(path), text=True)
        return tokenized_splits(path, data.tokenizer_path, val_fraction, lambda: self.tokenizer, field)

    def _too_short(self, split: str, tokens: int, path: Path, field: str = "data.dataset_path") -> str:
        seq_len, data = self.job.training.seq_len, self.job.data
        share = "" if data.val_dataset_path is not None else f" (data.val_fraction={data.val_fraction})"
        return (f"the {split} split of {field}={str(path)!r}{share} has "
                f"{tokens} tokens, fewer than one window of training.seq_len + 1 = {seq_len + 1}")

    def on_before_batch_transfer(self, batch: Any, dataloader_idx: int) -> Any:
        """The module's own preparation of a batch on the host, if it has one (CausalLMModule's
        ``prepare_batch_on_host``: varlen's document offsets), before Lightning moves it to the device."""
        prepare = getattr(getattr(self.trainer, "lightning_module", None), "prepare_batch_on_host", None)
        return prepare(batch) if callable(prepare) else batch

    def setup(self, stage: Optional[str] = None) -> None:
        if self._train is not None:
            return
        streams = self._read()
        if "sources" in streams:
            self._setup_sources(streams["sources"], stage)
        else:
            self._setup_corpus(streams, stage)
        if stage in (None, "fit") and self.trainer is not None and by_epochs(self.trainer):
            self._schedule_epochs(self.trainer)

    def _setup_corpus(self, streams: dict[str, Any], stage: Optional[str]) -> None:
        self._train = self.train_windows()
        if hasattr(self._train, "packing_line") and stage in (None, "fit") and getattr(self.trainer, "global_rank", 0) == 0:
            log.info(f"titan-lightning: train split: {self._train.packing_line()}")
        if streams["val"] is None:  # data.val_fraction 0: nothing held out
            if self.trainer is not None:
                self.trainer.limit_val_batches = 0  # nothing to validate on: Lightning asks for no val loader
            return
        if not self._fills_window(streams["val"]):
            path = CORPUS_PATH if self.job.data.dataset_path is None else Path(self.job.data.dataset_path)
            self._short_split = self._too_short("val", len(streams["val"]), path)
            if self._will_validate(stage):
                raise ValueError(self._short_split)
        self._val = None if self._short_split else self._windows(streams["val"])
        if self._will_validate(stage):
            self._check_val_covers_dp()

    @property
    def val_windows(self) -> Optional[TokenWindows | ConversationWindows]:
        """The held-out windows (None: nothing held out), after ``setup``."""
        return self._val

    def train_windows(self) -> TokenWindows | ConversationWindows:
        """The train split's windows (for SFT data the packing is computed here), built once per read."""
        streams = self._read()
        if "sources" in streams:
            raise ValueError("a mixture of data.sources has no train windows of its own")
        if self._built is None or self._built[0] != self._streams[0]:
            self._built = (self._streams[0], self._windows(streams["train"]))
        return self._built[1]

    def steps_per_epoch(self, dp_size: int, accumulation: int, epochs: int) -> int:
        """Optimizer steps in one pass over the train windows: each step takes ``dp_size`` x
        ``accumulation`` x training.microbatch_size windows, the last partial step left out.
        One-line ValueError when the windows do not fill one step (``epochs``: for the message)."""
        data = self.job.data
        if data.sources:
            raise ValueError(f"trainer.max_epochs={epochs}: a mixture of data.sources is a weighted stream with no "
                             f"epochs; set trainer.max_steps (and max_epochs -1)")
        windows, per_step = len(self.train_windows()), dp_size * accumulation * self.job.training.microbatch_size
        if windows < per_step:
            path = str(CORPUS_PATH if data.dataset_path is None else data.dataset_path)
            raise ValueError(
                f"trainer.max_epochs={epochs}: the train split of data.dataset_path={path!r} fills {windows} "
                f"window(s) of training.seq_len + 1 = {self.job.training.seq_len + 1} tokens, fewer than one "
                f"optimizer step takes ({dp_size} data-parallel rank(s) x {accumulation} microbatch(es) x "
                f"{self.job.training.microbatch_size} sequence(s) = {per_step}); lower "
                f"training.tokens_per_microbatch_per_dp_rank or tokens_per_step, or use more data")
        return windows // per_step

    def _schedule_epochs(self, trainer: L.Trainer) -> None:
        """A run by epochs: the samples of one epoch on this rank, ``max_steps`` (the epochs' steps,
        or fewer when the run's max_steps says so), and, where the run leaves Lightning's defaults,
        logging every min(50, max(1, steps // 100)) steps and VALIDATIONS_PER_RUN validations."""
        accumulation = trainer.accumulate_grad_batches
        steps = self.steps_per_epoch(self._dp()[0], accumulation, trainer.max_epochs)
        self._epoch_samples = steps * accumulation * self.job.training.microbatch_size
        total = steps * trainer.max_epochs
        if not 0 < trainer.max_steps <= total:
            trainer.fit_loop.epoch_loop.max_steps = total
        if trainer.log_every_n_steps == LIGHTNING_LOG_EVERY_N_STEPS:
            trainer.log_every_n_steps = min(LIGHTNING_LOG_EVERY_N_STEPS, max(1, trainer.max_steps // 100))
        lightning_default = trainer.val_check_interval == 1.0 and trainer.check_val_every_n_epoch == 1
        if self._val is not None and trainer.limit_val_batches != 0 and lightning_default:
            # Every `every` steps, counted over the whole run; FinalValidation adds the last step.
            every = max(1, math.ceil(trainer.max_steps / VALIDATIONS_PER_RUN))
            trainer.val_check_interval, trainer.check_val_every_n_epoch = every * accumulation, None

    def _setup_sources(self, sources: list[dict[str, Any]], stage: Optional[str]) -> None:
        seq_len = self.job.training.seq_len
        self._sources = [self._windows(s["train"]) for s in sources]
        self._train = self._sources[0]
        if not self.job.data.val_fraction:
            if self.trainer is not None:
                self.trainer.limit_val_batches = 0  # nothing held out: Lightning asks for no val loader
            return
        vals = [self._windows(s["val"]) for s in sources if self._fills_window(s["val"])]
        if not vals:
            self._short_split = (f"no source's val split (data.val_fraction={self.job.data.val_fraction}) fills one "
                                 f"window of training.seq_len + 1 = {seq_len + 1} tokens")
            if self._will_validate(stage):
                raise ValueError(self._short_split)
        self._val = ConcatWindows(vals) if vals else None
        if self._will_validate(stage):
            self._check_val_covers_dp()

    def _windows(self, tokens) -> TokenWindows | ConversationWindows:
        seq_len, eot, data = self.job.training.seq_len, self.tokenizer.eot_id, self.job.data
        if self.job.preference.enabled:
            return PairWindows(tokens, seq_len, eot, data.sft_packing)
        if data.sft:
            return ConversationWindows(tokens, seq_len, eot, data.sft_packing)
        return TokenWindows(tokens, seq_len, eot)

    def _fills_window(self, tokens) -> bool:
        # A split of SFT data holds at least one conversation (shard_splits), and one fills a window.
        return self.job.data.sft or len(tokens) >= self.job.training.seq_len + 1

    def schedule(self) -> MixtureSchedule:
        """The mixture of ``data.sources`` (from the resumed base, after a resume that changed weights)."""
        weights = [s.weight for s in self.job.data.sources]
        base_position, base_counts = self._mixture_base
        return MixtureSchedule(weights, self.job.training.seed, base_position, base_counts)

    def source_tokens(self) -> dict[str, int]:
        """Training tokens each source has given the whole run (all ranks), by source name."""
        position = self.consumed_samples * self._dp()[0]
        counts = self.schedule().counts_at(position)
        return {name: int(n) * self.job.training.seq_len for name, n in zip(self.job.data.source_names(), counts)}

    def _will_validate(self, stage: Optional[str]) -> bool:
        # Checked at setup, before any step, when validation will run; a run with
        # limit_val_batches=0 (long sequences on the small shipped corpus) needs no val split.
        trainer = self.trainer
        return trainer is None or (stage in (None, "fit", "validate") and trainer.limit_val_batches != 0)

    def train_dataloader(self) -> DataLoader:
        train = self._require_setup(self._train)
        dp_size, dp_rank = self._dp()
        self._start = self.consumed_samples
        self._counter = None if self.trainer is None else (self.trainer, _batches_trained(self.trainer))
        if self._sources:
            return self._loader(MixtureStream(self._sources, self.schedule(), seed=self.job.training.seed,
                                              dp_rank=dp_rank, dp_size=dp_size, start=self._start,
                                              batch_size=self.job.training.microbatch_size))
        where = dict(seed=self.job.training.seed, dp_rank=dp_rank, dp_size=dp_size, start=self._start,
                     batch_size=self.job.training.microbatch_size)
        if self._epoch_samples is not None:
            return self._loader(EpochStream(train, epoch_samples=self._epoch_samples, **where),
                                position=lambda: self.consumed_samples)
        return self._loader(TrainStream(train, **where))

    def val_dataloader(self) -> DataLoader | list:
        if self._train is not None and self._val is None and self._short_split is None:
            return []  # data.val_fraction 0: nothing held out, Lightning skips validation
        if self._train is not None and self._val is None:
            raise ValueError(self._short_split)
        val = self._require_setup(self._val)
        self._check_val_covers_dp()
        dp_size, dp_rank = self._dp()
        batch_size = self.job.training.microbatch_size
        return self._loader(ValWindows(val, dp_rank=dp_rank, dp_size=dp_size, batch_size=batch_size))

    @property
    def consumed_samples(self) -> int:
        """Training samples this rank has consumed (those of batches Lightning has trained on)."""
        if self._counter is None:
            return self._start
        trainer, batches_at_start = self._counter
        return self._start + (_batches_trained(trainer) - batches_at_start) * self.job.training.microbatch_size

    def state_dict(self) -> dict[str, Any]:
        state = {"consumed_samples": self.consumed_samples, "seed": self.job.training.seed, "dp_size": self._dp()[0]}
        if self.job.data.sources:
            base_position, base_counts = self._mixture_base
            state["mixture"] = {"weights": [s.weight for s in self.job.data.sources], "base_position": base_position,
                                "base_counts": base_counts}
        return state

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Resume at the saved position. On another data-parallel size the global position carries
        over (rank r of d visits samples r, r + d, ...): it must split evenly over the new ranks."""
        seed, dp_size = self.job.training.seed, self._dp()[0]
        if state_dict.get("seed") != seed:
            raise ValueError(
                f"cannot resume the data position saved with training.seed={state_dict.get('seed')} in a run with "
                f"training.seed={seed}"
            )
        consumed, saved_dp = int(state_dict["consumed_samples"]), int(state_dict["dp_size"])
        total = consumed * saved_dp
        if total % dp_size:
            raise ValueError(
                f"cannot resume the data position of {total} samples ({consumed} on each of {saved_dp} data-parallel "
                f"ranks) on {dp_size} data-parallel ranks: {total} is not divisible by {dp_size}"
            )
        self._start = total // dp_size
        self._counter = None
        if self.job.data.sources:
            self._mixture_base = self._resumed_base(state_dict.get("mixture"), total)

    def _resumed_base(self, saved: Optional[dict[str, Any]], total: int) -> tuple[int, Optional[list[int]]]:
        """The schedule's base after a resume at global position ``total``: the saved one for the
        same weights; for changed weights, the counts each source had reached (module docstring
        of data/mixture.py)."""
        weights = [s.weight for s in self.job.data.sources]
        if saved is None or len(saved["weights"]) != len(weights):
            had = "one source" if saved is None else f"{len(saved['weights'])} sources"
            raise ValueError(f"cannot resume the data position of a run with {had} in a run with "
                             f"{len(weights)} data.sources; a mixture resumes with the same number of sources")
        base = (int(saved["base_position"]), saved["base_counts"])
        if list(saved["weights"]) == weights:
            return base
        old = MixtureSchedule(saved["weights"], self.job.training.seed, *base)
        return total, old.counts_at(total).tolist()

    def _check_val_covers_dp(self) -> None:
        """A val split with no window at all (fewer windows than ranks is fine: ValWindows fills in)."""
        val = self._require_setup(self._val)
        if len(val) == 0:
            data = self.job.data
            fix = (f"give data.val_dataset_path={data.val_dataset_path!r} more data" if data.val_dataset_path else
                   f"raise data.val_fraction={data.val_fraction} (or 0: no validation)")
            raise ValueError(f"the val split has no window of training.seq_len={self.job.training.seq_len}; {fix}")

    def _dp(self) -> tuple[int, int]:
        kwargs = self.trainer.distributed_sampler_kwargs if self.trainer is not None else None
        if isinstance(kwargs, dict):
            return kwargs["num_replicas"], kwargs["rank"]
        return 1, 0

    def _loader(self, dataset: TrainStream | ValWindows, position: Optional[Callable[[], int]] = None) -> DataLoader:
        data, p = self.job.data, self.job.parallelism
        collate = None
        if data.sft and data.sft_packing == "padded":
            collate = TrimPadding(sequence_multiple(self.job.training.seq_len, p.seq_len_divisor, p.pp))
        kwargs = dict(batch_size=self.job.training.microbatch_size, num_workers=data.num_workers, collate_fn=collate)
        return DataLoader(dataset, **kwargs) if position is None else EpochLoader(dataset, position, **kwargs)

    @staticmethod
    def _require_setup(windows: Optional[TokenWindows]) -> TokenWindows:
        if windows is None:
            raise RuntimeError("TextDataModule.setup() must run before its dataloaders are built")
        return windows


def by_epochs(trainer: L.Trainer) -> bool:
    """Whether ``trainer`` runs a number of epochs (``max_epochs`` N >= 1) rather than an endless
    stream limited by ``max_steps`` (Lightning's max_epochs -1 when only max_steps is given)."""
    return trainer.max_epochs is not None and trainer.max_epochs >= 1


class EpochLoader(DataLoader):
    """The train loader of a run by epochs: each iteration (Lightning starts one per epoch) starts
    its EpochStream where training is, ``position()`` (the samples this rank has trained on).
    Resumable: the position is the data module's state, so Lightning's loader state is empty."""

    def __init__(self, dataset: EpochStream, position: Callable[[], int], **kwargs) -> None:
        super().__init__(dataset, **kwargs)
        self.position = position

    def __iter__(self):
        self.dataset.start = self.position()
        return super().__iter__()

    def state_dict(self) -> dict[str, Any]:
        return {}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        pass


# Token streams tokenized in this process, by corpus file and tokenizer file (path, size and
# modification time of each) and val_fraction, the newest few kept: the runs of one test
# session, and the ranks its fork server starts (titan_lightning/testing/zygote.py), tokenize
# the shipped corpus once instead of once per run and rank (~0.9 s of CPU each).
_TOKENIZED: "OrderedDict[tuple, dict[str, np.ndarray]]" = OrderedDict()
_TOKENIZED_KEPT = 4


def tokenized_splits(path: Path, tokenizer_path: Optional[str], val_fraction: float,
                     tokenizer: Callable[[], Tokenizer], field: str = "data.dataset_path") -> dict[str, np.ndarray]:
    """The ``train`` and ``val`` token streams of the corpus file ``path`` (the arrays are shared
    between callers: never write into them; val is None at ``val_fraction`` 0). ``tokenizer`` is
    called only on a miss.

    Raises FileNotFoundError/ValueError naming ``data.dataset_path`` or ``data.tokenizer_path``."""
    key = (_file_identity(path), _file_identity(tokenizer_file(tokenizer_path)), val_fraction)
    if key[0] is not None and key in _TOKENIZED:
        _TOKENIZED.move_to_end(key)
        return dict(_TOKENIZED[key])
    documents = read_documents(path)
    try:
        train_docs, val_docs = split_documents(documents, val_fraction) if val_fraction else (documents, None)
    except ValueError as error:
        raise ValueError(f"{field}={str(path)!r}: {error}") from None
    encoder = tokenizer()
    streams = {name: None if docs is None else tokenize_documents(docs, encoder)
               for name, docs in (("train", train_docs), ("val", val_docs))}
    if key[0] is not None:
        _TOKENIZED[key] = streams
        while len(_TOKENIZED) > _TOKENIZED_KEPT:
            _TOKENIZED.popitem(last=False)
    return dict(streams)


def shard_splits(path: Path, tokenizer_path: Optional[str], val_fraction: float,
                 tokenizer: Tokenizer, field: str = "data.dataset_path", *,
                 vocab_size: Optional[int] = None, sft: Optional[bool] = None,
                 preference: Optional[str] = None) -> dict[str, Any]:
    """The ``train`` and ``val`` spans of the token shard set ``path``: val is the tail from the
    last document end before ``1 - val_fraction`` of the tokens (None at 0). Refuses shards of another tokenizer,
    shards with token ids past ``vocab_size`` (the model's), and, given ``sft`` (data.sft), a set
    whose loss masks do not match it, or whose pairs do not match ``preference`` (preference.loss)."""
    shards = ShardSet(path, field)
    if sft is not None:
        check_loss_mask(shards.has_mask, sft, field, str(path))
        check_supervised(shards.index, field, str(path))
        check_pairs(shards.index, preference, field, str(path))
    bos = tokenizer.bos_id if tokenizer.add_bos else None
    shards.check_tokenizer(tokenizer_identity(tokenizer_file(tokenizer_path), tokenizer.vocab_size,
                                              tokenizer.eot_id, bos))
    if vocab_size is not None:
        shards.check_vocab(vocab_size, field)
        scan_token_ids(shards)
    if not val_fraction:
        return {"train": TokenSpan(shards, 0, len(shards)), "val": None}
    split = shards.document_end_before(int(len(shards) * (1 - val_fraction)))
    if split == 0 or split == len(shards):
        raise ValueError(f"{field}={str(path)!r}: the train/val split is by documents, and "
                         f"{shards.index['documents']} document(s) cannot give both splits at "
                         f"data.val_fraction={val_fraction}")
    return {"train": TokenSpan(shards, 0, split), "val": TokenSpan(shards, split, len(shards))}


def _file_identity(path: Path) -> Optional[tuple[str, int, int]]:
    try:
        stat = path.stat()
    except OSError:
        return None  # read_documents names the problem
    return str(path.resolve()), stat.st_size, stat.st_mtime_ns


def _batches_trained(trainer: L.Trainer) -> int:
    """Training batches whose step has run, over the whole run (restored with the fit loop).

    ``processed``, not ``completed``: ModelCheckpoint saves in ``on_train_batch_end``, after
    ``processed`` and before ``completed`` counts the batch. Nor what the DataLoader yielded:
    Lightning's fetcher has prefetched one batch more.
    """
    return trainer.fit_loop.epoch_loop.batch_progress.total.processed
