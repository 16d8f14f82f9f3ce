"""The shipped corpus and tokenizer, the datasets, and TextDataModule's resumable position."""

import itertools
import platform
import re
from pathlib import Path
from types import SimpleNamespace

import lightning as L
import numpy as np
import pytest
import torch
from torch.utils.data import DataLoader

from titan_lightning.config import DataConfig, JobConfig, TrainingConfig
from titan_lightning.data.datamodule import TextDataModule
from titan_lightning.models.common.loss import IGNORE_INDEX
from titan_lightning.data.dataset import (
    TokenWindows,
    TrainStream,
    ValWindows,
    format_corpus,
    read_documents,
    split_documents,
)
from titan_lightning.data.tokenizer import (
    CORPUS_PATH,
    TOKENIZER_PATH,
    load_tokenizer,
    reference_documents,
    shipped_asset,
    train_tokenizer,
)

CORPUS_README = (CORPUS_PATH.parent / "README.md").read_text()
SHIPPED_PYTHON = re.search(r"Python version: (\S+)", CORPUS_README).group(1)
same_python = pytest.mark.skipif(
    platform.python_version() != SHIPPED_PYTHON,
    reason=f"the shipped assets come from Python {SHIPPED_PYTHON}'s pydoc_data",
)

SEQ_LEN = 4


def job(seq_len: int = 64, batch_size: int = 2, seed: int = 0, **data) -> JobConfig:
    return JobConfig(
        training=TrainingConfig(seq_len=seq_len, tokens_per_microbatch_per_dp_rank=seq_len * batch_size, seed=seed),
        data=DataConfig(**data),
    )


def numbered_windows(n: int) -> TokenWindows:
    """Windows whose first input token is ``index * SEQ_LEN``, so a sample names its window."""
    return TokenWindows(np.arange(n * SEQ_LEN + 1, dtype=np.int32), SEQ_LEN)


def window_ids(samples) -> list[int]:
    return [int(sample["input_ids"][0]) // SEQ_LEN for sample in samples]


def take(dataset, n: int) -> list[int]:
    return window_ids(itertools.islice(dataset, n))


# --- corpus -------------------------------------------------------------------------------------


def test_shipped_corpus_is_english_prose_under_the_psf_license():
    text = CORPUS_PATH.read_text(encoding="utf-8")
    visible = [c for c in text if not c.isspace()]
    assert len(CORPUS_PATH.read_bytes()) < 4_000_000
    assert len(text.split()) > 60_000
    assert sum(c.isascii() and c.isalpha() for c in visible) / len(visible) > 0.8
    assert len(read_documents(CORPUS_PATH)) > 50
    assert "Python Software Foundation License" in CORPUS_README
    assert "python -m titan_lightning.data.tokenizer" in CORPUS_README


@same_python
def test_corpus_regenerates_byte_identically_from_pydoc_data():
    assert format_corpus(reference_documents()).encode("utf-8") == CORPUS_PATH.read_bytes()
    assert read_documents(CORPUS_PATH) == reference_documents()


def test_val_split_is_the_tail_of_documents_holding_val_fraction_of_the_text():
    docs = ["a" * 50, "b" * 30, "c" * 15, "d" * 5]
    assert split_documents(docs, 0.05) == (docs[:3], docs[3:])
    assert split_documents(docs, 0.06) == (docs[:2], docs[2:])
    assert split_documents(docs, 0.9) == (docs[:1], docs[1:])
    with pytest.raises(ValueError, match="at least 2"):
        split_documents(docs[:1], 0.05)


# --- tokenizer ----------------------------------------------------------------------------------


def test_shipped_tokenizer_has_2048_tokens_and_an_end_of_text_token():
    tokenizer = load_tokenizer()
    assert tokenizer.vocab_size == 2048
    assert 0 <= tokenizer.eot_id < 2048
    assert tokenizer.encode("<|endoftext|>") == [tokenizer.eot_id]


@pytest.mark.parametrize(
    "text",
    ["The assert statement", "def f(x):\n    return x ** 2\n", "naïve café — 日本語 🙂", "  tabs\t\tand\n\n\n", ""],
)
def test_tokenizer_round_trips_text(text):
    tokenizer = load_tokenizer()
    ids = tokenizer.encode(text)
    assert all(0 <= i < tokenizer.vocab_size for i in ids)
    assert tokenizer.decode(ids) == text


def test_tokenizer_ids_for_a_fixed_string_are_stable():
    assert load_tokenizer().encode("def f(x):\n    return x") == [1037, 286, 8, 88, 865, 870, 492, 893]


@same_python
def test_retraining_the_tokenizer_reproduces_the_shipped_file():
    train, _ = split_documents(read_documents(CORPUS_PATH), DataConfig().val_fraction)
    first, second = train_tokenizer(train).to_str(pretty=True), train_tokenizer(train).to_str(pretty=True)
    assert first == second == TOKENIZER_PATH.read_text(encoding="utf-8")


def test_missing_tokenizer_file_is_named(tmp_path):
    missing = str(tmp_path / "nope.json")
    with pytest.raises(FileNotFoundError, match=re.escape(missing)):
        load_tokenizer(missing)


# --- datasets -----------------------------------------------------------------------------------


def test_labels_are_inputs_shifted_by_one_and_windows_cover_the_stream():
    tokens = np.random.default_rng(0).integers(0, 2048, size=103, dtype=np.int32)
    windows = TokenWindows(tokens, 10)
    assert len(windows) == 10
    inputs = torch.cat([windows[i]["input_ids"] for i in range(len(windows))])
    labels = torch.cat([windows[i]["labels"] for i in range(len(windows))])
    assert windows[0]["input_ids"].dtype == windows[0]["labels"].dtype == torch.long
    assert torch.equal(inputs, torch.from_numpy(tokens[:100]).long())
    assert torch.equal(labels, torch.from_numpy(tokens[1:101]).long())


def test_each_training_epoch_visits_every_window_once_in_a_seeded_order():
    windows = numbered_windows(10)
    order = take(TrainStream(windows, seed=0), 30)
    assert all(sorted(order[e * 10 : (e + 1) * 10]) == list(range(10)) for e in range(3))
    assert order[:10] != order[10:20]
    assert take(TrainStream(windows, seed=0), 30) == order
    assert take(TrainStream(windows, seed=1), 30) != order


@pytest.mark.parametrize("dp_size", [2, 3])
def test_dp_ranks_together_read_the_single_rank_stream_interleaved(dp_size):
    windows = numbered_windows(7)
    single = take(TrainStream(windows, seed=3), 7 * dp_size * 2)
    ranks = [take(TrainStream(windows, seed=3, dp_rank=r, dp_size=dp_size), 14) for r in range(dp_size)]
    assert [ranks[g % dp_size][g // dp_size] for g in range(len(single))] == single


@pytest.mark.parametrize("start", [3, 9, 10, 23])
def test_train_stream_resumes_exactly_at_start_across_epochs(start):
    windows = numbered_windows(10)
    for rank in range(2):
        whole = take(TrainStream(windows, seed=5, dp_rank=rank, dp_size=2), 40)
        resumed = take(TrainStream(windows, seed=5, dp_rank=rank, dp_size=2, start=start), 40 - start)
        assert resumed == whole[start:]


def test_val_windows_are_finite_in_order_and_equal_per_rank():
    """Every window is validated once; a rank short of one gets window 0 with every label ignored."""
    windows = numbered_windows(11)
    ranks = [list(ValWindows(windows, dp_rank=r, dp_size=3)) for r in range(3)]
    assert [window_ids(samples) for samples in ranks] == [[0, 3, 6, 9], [1, 4, 7, 10], [2, 5, 8, 0]]
    assert (ranks[2][-1]["labels"] == IGNORE_INDEX).all() and not (ranks[2][0]["labels"] == IGNORE_INDEX).any()
    assert len(ValWindows(windows, dp_rank=0, dp_size=3)) == 4
    assert window_ids(ValWindows(windows)) == list(range(11))
    assert [window_ids(ValWindows(numbered_windows(1), dp_rank=r, dp_size=4)) for r in range(4)] == [[0]] * 4


@pytest.mark.parametrize("dataset", ["train", "val"])
def test_dataloader_workers_yield_the_batches_of_a_single_process(dataset):
    windows = numbered_windows(13)
    make = {
        "train": lambda: TrainStream(windows, seed=0, dp_rank=1, dp_size=2, start=5, batch_size=3),
        "val": lambda: ValWindows(windows, dp_rank=1, dp_size=2, batch_size=4),
    }[dataset]

    def batches(num_workers):
        loader = DataLoader(make(), batch_size=make().batch_size, num_workers=num_workers)
        return [b["input_ids"].tolist() for b in itertools.islice(loader, 8)]

    assert batches(2) == batches(0)


# --- TextDataModule -----------------------------------------------------------------------------


@pytest.fixture(scope="module")
def shipped() -> TextDataModule:
    datamodule = TextDataModule(job())
    datamodule.setup()
    return datamodule


def first_batches(datamodule: TextDataModule, n: int) -> list[list[list[int]]]:
    return [b["input_ids"].tolist() for b in itertools.islice(datamodule.train_dataloader(), n)]


def test_datamodule_without_trainer_gives_batches_of_the_configured_shape(shipped):
    batch = next(iter(shipped.train_dataloader()))
    assert batch["input_ids"].shape == batch["labels"].shape == (2, 64)
    assert torch.equal(batch["input_ids"][:, 1:], batch["labels"][:, :-1])
    val = list(shipped.val_dataloader())
    assert len(val) == len(shipped.val_dataloader()) > 0
    assert [b["input_ids"].tolist() for b in shipped.val_dataloader()] == [b["input_ids"].tolist() for b in val]
    assert shipped.state_dict() == {"consumed_samples": 0, "seed": 0, "dp_size": 1}


def test_load_state_dict_resumes_at_the_saved_sample(shipped):
    resumed = TextDataModule(job())
    resumed.setup()
    resumed.load_state_dict({"consumed_samples": 6, "seed": 0, "dp_size": 1})
    assert resumed.state_dict()["consumed_samples"] == 6
    assert first_batches(resumed, 2) == first_batches(shipped, 5)[3:]


@pytest.mark.parametrize("saved, message", [
    ({"consumed_samples": 4, "seed": 1, "dp_size": 1}, r"training.seed=1 in a run with training.seed=0"),
    ({"consumed_samples": 3, "seed": 0, "dp_size": 1, "_dp": 2},
     r"position of 3 samples \(3 on each of 1 data-parallel ranks\) on 2 data-parallel ranks"),
])
def test_load_state_dict_refuses_another_seed_or_an_uneven_split(saved, message, monkeypatch):
    datamodule = TextDataModule(job())
    monkeypatch.setattr(datamodule, "_dp", lambda: (saved.pop("_dp", 1), 0))
    with pytest.raises(ValueError, match=message):
        datamodule.load_state_dict(saved)


def test_load_state_dict_on_another_dp_size_keeps_the_global_position(shipped, monkeypatch):
    """Saved by 2 data-parallel ranks after 3 samples each: one rank resumes at global sample 6."""
    resumed = TextDataModule(job())
    resumed.setup()
    resumed.load_state_dict({"consumed_samples": 3, "seed": 0, "dp_size": 2})
    assert resumed.state_dict()["consumed_samples"] == 6
    assert first_batches(resumed, 2) == first_batches(shipped, 5)[3:]


class Recorder(L.LightningModule):
    """Trains one scalar on the batches and records their input ids."""

    def __init__(self) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(torch.zeros(()))
        self.seen: list[list[list[int]]] = []

    def training_step(self, batch, batch_idx):
        self.seen.append(batch["input_ids"].tolist())
        return (self.weight - batch["input_ids"].float().mean()) ** 2

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.0)


def fit(max_steps: int, ckpt_path=None, callbacks=(), default_root_dir=None) -> tuple[Recorder, L.Trainer]:
    model, datamodule = Recorder(), TextDataModule(job())
    trainer = L.Trainer(
        max_steps=max_steps,
        accelerator="cpu",
        logger=False,
        enable_checkpointing=bool(callbacks),
        callbacks=list(callbacks),
        enable_progress_bar=False,
        enable_model_summary=False,
        default_root_dir=default_root_dir,
    )
    trainer.fit(model, datamodule=datamodule, ckpt_path=ckpt_path)
    return model, trainer


@pytest.fixture(scope="module")
def five_steps() -> list:
    return fit(5)[0].seen


@pytest.mark.filterwarnings("ignore::UserWarning")
def test_trainer_resumes_from_checkpoint_saved_after_fit(tmp_path, five_steps):
    first, trainer = fit(3)
    trainer.save_checkpoint(tmp_path / "step3.ckpt")
    assert trainer.datamodule.state_dict()["consumed_samples"] == 6
    second, _ = fit(5, ckpt_path=tmp_path / "step3.ckpt")
    assert first.seen + second.seen == five_steps


@pytest.mark.filterwarnings("ignore::UserWarning")
def test_trainer_resumes_from_model_checkpoint_saved_mid_epoch(tmp_path, five_steps):
    every_3 = L.pytorch.callbacks.ModelCheckpoint(dirpath=tmp_path, every_n_train_steps=3, save_top_k=-1)
    fit(4, callbacks=[every_3], default_root_dir=tmp_path)
    (ckpt,) = Path(tmp_path).glob("*step=3.ckpt")
    assert torch.load(ckpt, weights_only=False)["TextDataModule"]["consumed_samples"] == 6
    resumed, _ = fit(5, ckpt_path=ckpt)
    assert resumed.seen == five_steps[3:]


# --- errors -------------------------------------------------------------------------------------


def test_corpus_too_short_for_one_window_names_the_sizes(tmp_path):
    corpus = tmp_path / "tiny.txt"
    corpus.write_text(format_corpus(["A short document.", "Another one."]), encoding="utf-8")
    datamodule = TextDataModule(job(dataset_path=str(corpus)))
    with pytest.raises(ValueError, match=r"training.seq_len \+ 1 = 65"):
        datamodule.setup()


def test_missing_corpus_file_is_named(tmp_path):
    missing = str(tmp_path / "missing.txt")
    with pytest.raises(FileNotFoundError, match=re.escape(missing)):
        TextDataModule(job(dataset_path=missing)).setup()


def test_corpus_of_one_document_cannot_be_split(tmp_path):
    corpus = tmp_path / "one.txt"
    corpus.write_text("word " * 1000, encoding="utf-8")
    with pytest.raises(ValueError, match=re.escape(str(corpus))):
        TextDataModule(job(dataset_path=str(corpus))).setup()


def test_missing_shipped_asset_names_the_path_and_the_rebuild_command(tmp_path):
    with pytest.raises(FileNotFoundError, match=r"gone\.json.*python -m titan_lightning\.data\.tokenizer"):
        shipped_asset(tmp_path / "gone.json")


def test_val_split_with_fewer_windows_than_dp_ranks_gives_every_rank_the_same_count():
    datamodule = TextDataModule(job(seq_len=2048, batch_size=1))
    datamodule.setup()
    counts = set()
    for rank in range(8):
        datamodule.trainer = SimpleNamespace(distributed_sampler_kwargs={"num_replicas": 8, "rank": rank})
        counts.add(len(list(datamodule.val_dataloader())))
    assert counts == {1}


# --- prepare: one large file cut into pieces ----------------------------------------------------


def test_one_file_is_cut_into_pieces_written_as_one_worker_writes_it_and_resumed(tmp_path, monkeypatch):
    """JSONL (cut at line ends), text (at <|endoftext|>) and Parquet (by rows) pieces of one part
    each; their documents copied, in order, into the part's shards: the files of one worker, byte
    for byte, also after an interruption between pieces."""
    import json

    from titan_lightning.data import prepare as prepare_module
    from titan_lightning.data.prepare import plan_parts, prepare, split_part

    docs = reference_documents()[:60]
    (tmp_path / "a.jsonl").write_text("".join(json.dumps({"text": d}) + "\n" for d in docs[:30]) + "not json\n")
    (tmp_path / "b.txt").write_text("\n<|endoftext|>\n".join(docs[30:50]))
    files = [tmp_path / "a.jsonl", tmp_path / "b.txt"]
    pq = pytest.importorskip("pyarrow.parquet", reason="Parquet support is the optional [parquet] extra")
    import pyarrow as pa

    pq.write_table(pa.table({"text": docs[50:]}), tmp_path / "c.parquet")  # one row group
    files.append(tmp_path / "c.parquet")
    inputs = [str(f) for f in files]
    prepare(inputs, str(tmp_path / "one"), workers=1, progress=False, shard_tokens=3000)
    parts = plan_parts(files)
    assert len(parts) == 3 and all(len(split_part(part, 4)) > 2 for part in parts)

    real_map, real_run, pieces = prepare_module._map, prepare_module._run_part, []
    # Two workers' jobs, run in this process (cheap, and an interruption can be placed).
    monkeypatch.setattr(prepare_module, "_map", lambda f, jobs, path, workers, counter: real_map(f, jobs, path, 1,
                                                                                                  counter))
    monkeypatch.setattr(prepare_module, "MIN_PIECE_BYTES", 1)

    def interrupted_at_the_sixth(job):
        pieces.append(job[:3])
        if len(pieces) == 6:
            raise KeyboardInterrupt
        return real_run(job)

    monkeypatch.setattr(prepare_module, "_run_part", interrupted_at_the_sixth)
    with pytest.raises(KeyboardInterrupt):
        prepare(inputs, str(tmp_path / "two"), workers=2, progress=False, shard_tokens=3000)
    assert pieces[0][2] > 2 and pieces[5][0] > 0  # part 0 was cut into pieces, and finished
    assert list(json.loads((tmp_path / "two" / "progress.json").read_text())["done"]) == ["0"]
    assert not any(p.name.startswith("piece-") for p in (tmp_path / "two").iterdir())
    monkeypatch.setattr(prepare_module, "_run_part", real_run)
    summary = prepare(inputs, str(tmp_path / "two"), workers=2, progress=False, shard_tokens=3000)
    names = sorted(p.name for p in (tmp_path / "one").iterdir())
    assert summary["bad_records"] == 1 and summary["first_bad"] == f"{tmp_path / 'a.jsonl'}:31: not a JSON line"
    assert len([n for n in names if n.endswith(".tokens")]) > 3  # part 0 spans shards
    assert names == sorted(p.name for p in (tmp_path / "two").iterdir())
    for name in names:
        assert (tmp_path / "one" / name).read_bytes() == (tmp_path / "two" / name).read_bytes(), name


def test_a_token_shard_edited_after_prepare_is_named_by_the_read_that_meets_it(tmp_path):
    """The index records the largest id (checked against the model before launch); every read of
    the tokens checks them against it: an id written into the file later is named with its shard,
    before launch when the scan's sample holds it, else by the batch that reads it."""
    from titan_lightning.data.shards import ShardSet
    from titan_lightning.data.tokenizer import scan_token_ids
    from titan_lightning.testing.sft_shards import write_sft_shards

    ids = np.arange(1, 3001, dtype=np.int64) % 2000 + 1
    folder = write_sft_shards(tmp_path / "set", [(ids[:1500], ids[:1500] * 0), (ids[1500:], ids[1500:] * 0)],
                              loss_mask=False)
    file = folder / "part-00000-00000.tokens"
    tokens = np.fromfile(file, "<u2")
    tokens[2500] = 4000
    tokens.tofile(file)
    shards = ShardSet(folder)
    assert shards.max_id() == 2000 and shards.read(0, 2500).max() <= 2000
    scan_token_ids(shards, tokens=1000)  # the first 1000 tokens: not the edited one
    message = rf"^{file} holds token id 4000 \(its token 2500\), above the largest id its index.json records \(2000\)"
    with pytest.raises(ValueError, match=message):
        shards.tokens[2400:2600]
    with pytest.raises(ValueError, match=message):
        scan_token_ids(shards)
