"""Runs by epochs (``--trainer.max_epochs N``): N passes over the conversations, counted; max_steps
and the progress bar's total derived from the data; the last partial step left out and each epoch
reshuffled; a resume mid-epoch trains the same batches; the held-out split whole conversations,
deterministic and disjoint from training; recipes.hf:sft validates by default and logs val/loss."""

import csv
import json
import warnings
from collections import Counter
from pathlib import Path

import lightning as L
import numpy as np
import pytest

from recipes.tests import features
from titan_lightning.data.dataset import EpochStream, TokenWindows
from titan_lightning.data.datamodule import TextDataModule
from titan_lightning.recipe import check_inputs, execute
from titan_lightning.steps import ends_optimizer_step
from titan_lightning.testing.sft_shards import write_sft_shards
from titan_lightning.trainer import RUN_DIR_ENV, build_trainer

from tests.hf_folders import VOCAB, save_hf_folder

FIRST = 100  # conversation i starts with token FIRST + i: a batch row says which conversation it is


def _conversations(n: int, vocab: int = 2000) -> list[tuple[np.ndarray, np.ndarray]]:
    rng = np.random.default_rng(0)
    out = []
    for i in range(n):
        length = int(rng.integers(10, 60))
        tokens = np.concatenate([[FIRST + i], rng.integers(FIRST + n, vocab, length - 2), [0]])
        mask = np.zeros(length, np.uint8)
        mask[length // 2:] = 1
        out.append((tokens, mask))
    return out


class Seen(L.Callback):
    """The conversations of every trained batch, the train/loss of every step, the bar's total."""

    def __init__(self) -> None:
        self.rows, self.losses, self.totals = [], [], set()

    def on_train_batch_start(self, trainer, module, batch, batch_idx) -> None:
        self.rows.append([token - FIRST for token in batch["input_ids"][:, 0].tolist()])
        self.totals.add((trainer.current_epoch, trainer.progress_bar_callback.train_progress_bar.total))

    def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx) -> None:
        if ends_optimizer_step(trainer, batch_idx):
            self.losses.append(float(trainer.callback_metrics["train/loss"]))


def _fit(tmp_path, monkeypatch, data, name, *, val_fraction=0.0, checkpoint=None, resume=None, **trainer):
    """A one-process SFT run of a 1-layer model: 4 conversations a microbatch, 2 microbatches a step
    (8 a step), one conversation a sample (padded)."""
    run = features.llama3_small()
    job = run.job
    job.model.dim, job.model.n_layers, job.model.n_heads, job.model.n_kv_heads = 32, 1, 2, 2
    job.data.dataset_path, job.data.sft, job.data.sft_packing = str(data), True, "padded"
    job.data.val_fraction = val_fraction
    job.training.tokens_per_microbatch_per_dp_rank, job.training.tokens_per_step = 256, 512
    job.lr_schedule.warmup_steps = 0
    job.checkpoint.interval, job.checkpoint.resume_from = checkpoint, resume
    seen = Seen()
    run.trainer = dict(accelerator="cpu", devices=1, callbacks=[seen], enable_checkpointing=checkpoint is not None,
                       **trainer)
    monkeypatch.setenv(RUN_DIR_ENV, str(tmp_path / name))
    built = build_trainer(run)
    check_inputs("fit", run, built)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        execute("fit", run, built)
    return built, seen, [str(w.message) for w in caught]


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    return write_sft_shards(tmp_path_factory.mktemp("epochs") / "sft", _conversations(24))


def test_max_epochs_n_trains_every_conversation_n_times_and_derives_max_steps_and_the_bar_total(
        data, tmp_path, monkeypatch):
    trainer, seen, _ = _fit(tmp_path, monkeypatch, data, "run", max_epochs=2)
    # 24 conversations, 8 a step: 3 steps (6 batches) an epoch, 2 epochs.
    assert trainer.max_steps == 6 and trainer.global_step == 6 and trainer.num_training_batches == 6
    assert Counter(c for row in seen.rows for c in row) == {c: 2 for c in range(24)}
    first, second = sum(seen.rows[:6], []), sum(seen.rows[6:], [])
    assert sorted(first) == sorted(second) == list(range(24)) and first != second  # reshuffled
    assert seen.totals == {(0, 6), (1, 6)}
    assert trainer.log_every_n_steps == 1  # a short run logs every step


def test_max_steps_given_with_epochs_ends_the_run_first_and_the_schedule_with_it(data, tmp_path, monkeypatch):
    trainer, seen, _ = _fit(tmp_path, monkeypatch, data, "run", max_epochs=2, max_steps=4)
    assert trainer.max_steps == 4 and trainer.global_step == 4 and len(seen.rows) == 8
    assert seen.totals == {(0, 6), (1, 2)}  # the last epoch's bar ends at step 4


def test_an_epoch_leaves_out_its_last_partial_step_and_reshuffles_what_it_leaves_out():
    windows = TokenWindows(np.arange(27 * 4 + 1, dtype=np.int32), seq_len=4)  # 27 windows

    def epoch(e, rank, start=0):
        stream = EpochStream(windows, epoch_samples=12, seed=3, dp_rank=rank, dp_size=2, batch_size=2,
                             start=e * 12 + start)  # 2 ranks x 12: 3 steps of 8, 3 windows left out
        return [int(s["input_ids"][0]) // 4 for s in stream]

    epochs = [sorted(epoch(e, 0) + epoch(e, 1)) for e in range(2)]
    assert all(len(set(e)) == 24 for e in epochs) and epochs[0] != epochs[1]
    assert len(epoch(0, 0)) == 12 and epoch(1, 1, start=5) == epoch(1, 1)[5:]  # a start mid-epoch continues

    def steps(dp, batch):  # each step's windows, on dp ranks of `batch` samples each (4 samples a step)
        ranks = [[int(s["input_ids"][0]) // 4 for s in EpochStream(windows, epoch_samples=6 * batch, seed=3, dp_rank=r,
                                                                  dp_size=dp, batch_size=batch, start=6 * batch)]
                 for r in range(dp)]
        return [sorted(w for rank in ranks for w in rank[k * batch:(k + 1) * batch]) for k in range(6)]

    assert steps(1, 4) == steps(2, 2) == steps(4, 1)  # the same steps on every layout of the same global batch


def test_a_run_by_epochs_resumed_mid_epoch_trains_the_same_batches_and_losses(data, tmp_path, monkeypatch):
    straight, seen, _ = _fit(tmp_path, monkeypatch, data, "straight", max_epochs=2, checkpoint=2)
    step2 = tmp_path / "straight" / "checkpoints" / "epoch=0-step=2.ckpt"
    assert step2.exists()
    resumed, again, caught = _fit(tmp_path, monkeypatch, data, "resumed", max_epochs=2, resume=str(step2))
    assert resumed.global_step == 6 and len(again.rows) == 8
    assert len(seen.losses) == 6 and len(set(seen.losses)) == 6
    assert again.rows == seen.rows[4:] and again.losses == seen.losses[2:]  # epoch 0's last step, then epoch 1
    assert not [w for w in caught if "not resumable" in w]


def test_the_held_out_split_is_whole_conversations_the_same_on_every_run_and_never_trained(
        tmp_path, monkeypatch):
    data = write_sft_shards(tmp_path / "sft", _conversations(40))
    # Validation every 3 steps of 4 (6 batches), and after the last (FinalValidation).
    trainer, seen, caught = _fit(tmp_path, monkeypatch, data, "run", max_epochs=1, val_fraction=0.2,
                                 val_check_interval=6, check_val_every_n_epoch=None)
    trained = {c for row in seen.rows for c in row}

    def held_out():
        module = TextDataModule(trainer.lightning_module.job)
        module.setup("validate")
        return {int(b["input_ids"][i, 0]) - FIRST for b in module.val_dataloader() for i in range(len(b["input_ids"]))}

    val = held_out()
    assert val and val == held_out() and not val & trained  # the tail of whole conversations
    assert val == set(range(40 - len(val), 40)) and len(trained) + len(val) <= 40
    rows = list(csv.DictReader(open(tmp_path / "run" / "csv" / "metrics.csv")))
    validated = [int(r["step"]) + 1 for r in rows if r.get("val/loss")]
    assert trainer.max_steps == 4 and validated == [3, 4] and all(r.get("val/ppl") for r in rows if r.get("val/loss"))
    assert not [w for w in caught if "sync_dist" in w]


def test_recipes_hf_sft_trains_by_epochs_and_validates_by_default(tmp_path, monkeypatch):
    pytest.importorskip("transformers", reason="tests/hf_folders.py writes the folder with transformers")
    from titan_lightning.cli import main
    from titan_lightning.data.shards import tokenizer_identity
    from titan_lightning.data.tokenizer import load_tokenizer

    folder = save_hf_folder(tmp_path / "hf", "qwen3")  # max_position_embeddings 64: windows of 64 tokens
    tokenizer = load_tokenizer(str(folder))
    identity = tokenizer_identity(folder / "tokenizer.json", tokenizer.vocab_size, tokenizer.eot_id,
                                  tokenizer.bos_id if tokenizer.add_bos else None)
    conversations = [(np.where(t == 0, tokenizer.eot_id, t % (tokenizer.vocab_size - 1)), m)
                     for t, m in _conversations(40, vocab=VOCAB)]
    data = write_sft_shards(tmp_path / "sft", conversations, tokenizer=identity)
    monkeypatch.setenv(RUN_DIR_ENV, str(tmp_path / "run"))
    assert main(["fit", "--recipe", "recipes.hf:sft", "--job.checkpoint.initial_load_path", str(folder),
                 "--job.data.dataset_path", str(data), "--trainer.accelerator", "cpu", "--trainer.max_epochs", "1",
                 "--trainer.enable_progress_bar", "false", "--job.checkpoint.export_format", "null"]) == 0
    rows = list(csv.DictReader(open(tmp_path / "run" / "csv" / "metrics.csv")))
    steps = max(int(r["step"]) for r in rows if r.get("train/loss")) + 1
    validated = [int(r["step"]) + 1 for r in rows if r.get("val/loss")]
    assert len(validated) >= 2 and validated[-1] == steps  # through the run and after its last step
    assert sum(1 for r in rows if r.get("train/loss")) == steps  # every step logged
    assert json.loads((data / "index.json").read_text())["documents"] == 40  # >= 20: 5% held out


def test_a_held_out_set_of_its_own_validates_and_the_whole_dataset_trains(data, tmp_path, capsys):
    held_out = write_sft_shards(tmp_path / "val", _conversations(30)[24:])  # 6 conversations of their own
    job = features.llama3_small().job
    job.data.dataset_path, job.data.val_dataset_path = str(data), str(held_out)
    job.data.sft, job.data.sft_packing, job.model.mask, job.model.positions = True, "padded", "causal", "rope"
    module = TextDataModule(job)
    module.setup("fit")
    assert len(module._train) == 24  # no share of dataset_path held out
    # The log says how full the windows are: one conversation per padded window.
    tokens, window = int(module._train.ends[-1]), job.training.seq_len + 1
    line = next(x for x in capsys.readouterr().out.splitlines() if "train split:" in x)
    assert f"24 conversation(s) in 24 window(s) of {window:,} tokens (data.sft_packing padded): " \
           f"{100 * tokens / (24 * window):.1f}% of window tokens are conversation tokens" in line, line
    val = sorted(int(b["input_ids"][i, 0]) - FIRST for b in module.val_dataloader() for i in range(len(b["input_ids"])))
    assert val == list(range(24, 30))  # held_out's conversations, every one


@pytest.mark.parametrize("name, extra, message", [
    ("fewer windows than a step", ["--trainer.max_epochs", "1", "--job.training.tokens_per_step", "8192"],
     "fewer than one optimizer step takes (1 data-parallel rank(s) x 32 microbatch(es) x 4 sequence(s) = 128)"),
    ("a mixture by epochs", ["--trainer.max_steps", "-1", "--job.data.sources", '[{"path": "DATA"}]',
                             "--job.data.dataset_path", "null"],
     "trainer.max_steps=-1 runs by epochs, and a mixture of data.sources is a weighted stream with no epochs"),
])
def test_a_run_by_epochs_the_data_cannot_fill_is_one_line_before_launch(name, extra, message, data, tmp_path,
                                                                          capfd, monkeypatch):
    from tests.unit_tests.cpu.test_bad_input import assert_refused

    argv = ["fit", "--recipe", "recipes.tests.features:llama3_small", "--job.data.dataset_path", str(data),
            "--job.data.sft", "true", "--job.data.sft_packing", "padded", "--trainer.accelerator", "cpu",
            *[a.replace("DATA", str(data)) for a in extra]]
    assert_refused(name, argv, message, tmp_path, capfd, monkeypatch)
