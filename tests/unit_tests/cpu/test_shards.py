"""Token shards and `titan-lightning prepare`: round trips, determinism over workers, resume after an
interruption, bad records, bad inputs, BOS/EOS per tokenizer layout, and a data module that reads
shards through memory maps."""

import contextlib
import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch

from titan_lightning.data import prepare as prepare_module
from titan_lightning.data.prepare import PrepareError, prepare
from titan_lightning.data.shards import ShardSet, ShardWriter, token_dtype, write_index
from titan_lightning.data.tokenizer import load_tokenizer, reference_documents

DOCS = reference_documents()


def _jsonl(path: Path, docs, field="text", extra_lines=()) -> Path:
    with path.open("w") as f:
        for i, doc in enumerate(docs):
            f.write(json.dumps({"id": i, field: doc}) + "\n")
        for line in extra_lines:
            f.write(line + "\n")
    return path


def _tokens(folder: Path) -> np.ndarray:
    shards = ShardSet(folder)
    return shards.read(0, len(shards))


@contextlib.contextmanager
def interrupted_at_part(n: int):
    """``prepare`` called inside stops as at Ctrl-C (KeyboardInterrupt) when it starts its ``n``-th part."""
    real, started = prepare_module._run_part, []

    def dies_on_the_nth(job):
        started.append(job[0])
        if len(started) == n:
            raise KeyboardInterrupt
        return real(job)

    with pytest.MonkeyPatch.context() as patch, pytest.raises(KeyboardInterrupt):
        patch.setattr(prepare_module, "_run_part", dies_on_the_nth)
        yield


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    root = tmp_path_factory.mktemp("corpus")
    _jsonl(root / "a.jsonl", DOCS[:30])
    (root / "sub").mkdir()
    _jsonl(root / "sub" / "b.jsonl", DOCS[30:50])
    (root / "c.txt").write_text("\n<|endoftext|>\n".join(DOCS[50:]))
    return root


def test_shards_round_trip_across_shard_borders(tmp_path):
    generator = np.random.default_rng(0)
    docs = [generator.integers(0, 70000, size=n) for n in generator.integers(1, 50, size=40)]
    writer = ShardWriter(tmp_path, "part-00000", token_dtype(70000), shard_tokens=100)
    for doc in docs:
        writer.add(doc)
    shards = writer.close()
    assert len(shards) > 5 and token_dtype(70000) == np.dtype("<u4") and token_dtype(65536) == np.dtype("<u2")
    write_index(tmp_path, token_dtype(70000), {"sha256": "x", "eos_id": 0, "bos_id": None}, shards)
    shard_set = ShardSet(tmp_path)
    stream = np.concatenate(docs)
    assert len(shard_set) == len(stream)
    for a, b in [(0, len(stream)), (95, 230), (99, 101), (len(stream) - 3, len(stream)), (7, 7)]:
        assert np.array_equal(shard_set.read(a, b), stream[a:b]), (a, b)
    ends = np.cumsum([len(d) for d in docs])
    for position in (0, 5, 99, 100, 101, 500, len(stream)):
        assert shard_set.document_end_before(position) == max([0, *(e for e in ends if e <= position)])


def test_prepare_reads_jsonl_folders_and_text_in_sorted_order(corpus, tmp_path):
    summary = prepare([str(corpus)], str(tmp_path / "out"), workers=1, progress=False)
    tokenizer = load_tokenizer()
    # sorted paths: a.jsonl, c.txt, sub/b.jsonl
    expected = np.concatenate(tokenizer.encode_documents(DOCS[:30] + DOCS[50:] + DOCS[30:50]))
    assert np.array_equal(_tokens(tmp_path / "out"), expected)
    assert summary["documents"] == len(DOCS) and summary["bad_records"] == 0
    assert not (tmp_path / "out" / "progress.json").exists()


def test_output_does_not_depend_on_workers_and_resumes_after_an_interruption(corpus, tmp_path, monkeypatch):
    monkeypatch.setattr(prepare_module, "PART_BYTES", 20_000)  # several parts per JSONL file
    prepare([str(corpus)], str(tmp_path / "one"), workers=1, progress=False)
    prepare([str(corpus)], str(tmp_path / "two"), workers=2, progress=False)
    files = sorted(p.name for p in (tmp_path / "one").iterdir())
    assert len([f for f in files if f.endswith(".tokens")]) > 3
    assert files == sorted(p.name for p in (tmp_path / "two").iterdir())
    for name in files:
        assert (tmp_path / "one" / name).read_bytes() == (tmp_path / "two" / name).read_bytes(), name

    with interrupted_at_part(4):
        prepare([str(corpus)], str(tmp_path / "resumed"), workers=1, progress=False)
    assert (tmp_path / "resumed" / "progress.json").is_file() and not (tmp_path / "resumed" / "index.json").exists()
    done_before = len(json.loads((tmp_path / "resumed" / "progress.json").read_text())["done"])
    assert done_before == 3
    prepare([str(corpus)], str(tmp_path / "resumed"), workers=1, progress=False)
    for name in files:
        assert (tmp_path / "one" / name).read_bytes() == (tmp_path / "resumed" / name).read_bytes(), name


def test_bad_records_are_skipped_and_counted_or_stop_the_run(tmp_path):
    path = _jsonl(tmp_path / "a.jsonl", DOCS[:3], extra_lines=["not json", '{"id": 7}', '{"text": 3}'])
    summary = prepare([str(path)], str(tmp_path / "out"), workers=1, progress=False)
    assert summary["bad_records"] == 3 and summary["documents"] == 3
    assert summary["first_bad"] == f"{path}:4: not a JSON line"
    with pytest.raises(PrepareError, match=rf"^{path}:4: not a JSON line \(--bad-records stop\)$"):
        prepare([str(path)], str(tmp_path / "out2"), workers=1, progress=False, bad_records="stop")


def test_a_stopped_prepare_leaves_nothing_behind(tmp_path, monkeypatch):
    """--bad-records stop on line 41, after earlier parts were written: no output folder (or, for a
    folder that was there, the folder as it was), the file and line in the error."""
    monkeypatch.setattr(prepare_module, "PART_BYTES", 2_000)  # parts before the bad line finish first
    path = _jsonl(tmp_path / "a.jsonl", DOCS[:40], extra_lines=["{not json", *map(json.dumps, [{"text": "x"}] * 9)])
    assert len(prepare_module.plan_parts([path])) > 2
    message = rf"^{path}:41: not a JSON line \(--bad-records stop\)$"
    with pytest.raises(PrepareError, match=message):
        prepare([str(path)], str(tmp_path / "new"), workers=1, progress=False, bad_records="stop")
    assert not (tmp_path / "new").exists()
    (tmp_path / "empty").mkdir()
    with pytest.raises(PrepareError, match=message):
        prepare([str(path)], str(tmp_path / "empty"), workers=2, progress=False, bad_records="stop")
    assert list((tmp_path / "empty").iterdir()) == []


def test_compressed_inputs_prepare_as_their_contents_and_name_themselves_in_errors(corpus, tmp_path, monkeypatch):
    """.jsonl.gz / .txt.bz2 / .json.xz / .jsonl.zst (as OpenAssistant and The Pile ship): the same shards
    as the plain files, the index naming the compressed inputs, no decompressed copy left behind; a
    resume matches the same compressed inputs; a bad record or a corrupt file names the compressed file."""
    import bz2
    import gzip
    import lzma

    import zstandard  # (the [zstd] extra, in [dev])

    packed = tmp_path / "packed"
    (packed / "sub").mkdir(parents=True)
    (packed / "a.jsonl.gz").write_bytes(gzip.compress((corpus / "a.jsonl").read_bytes()))
    (packed / "c.txt.bz2").write_bytes(bz2.compress((corpus / "c.txt").read_bytes()))
    (packed / "sub" / "b.jsonl.xz").write_bytes(lzma.compress((corpus / "sub" / "b.jsonl").read_bytes()))
    (packed / "d.jsonl.zst").write_bytes(zstandard.ZstdCompressor().compress(json.dumps({"text": "z"}).encode()))
    plain = tmp_path / "plain_inputs"
    shutil.copytree(corpus, plain)
    (plain / "d.jsonl").write_text(json.dumps({"text": "z"}))
    prepare([str(plain)], str(tmp_path / "plain"), workers=1, progress=False)
    monkeypatch.setattr(prepare_module, "PART_BYTES", 20_000)  # several parts: a resume has some to do
    with interrupted_at_part(3):
        prepare([str(packed)], str(tmp_path / "out" / "from_packed"), workers=1, progress=False)
    assert len(json.loads((tmp_path / "out" / "from_packed" / "progress.json").read_text())["done"]) == 2
    prepare([str(packed)], str(tmp_path / "out" / "from_packed"), workers=2, progress=False)
    assert np.array_equal(_tokens(tmp_path / "out" / "from_packed"), _tokens(tmp_path / "plain"))
    index = json.loads((tmp_path / "out" / "from_packed" / "index.json").read_text())
    assert [Path(p).name for p in index["sources"]] == ["a.jsonl.gz", "c.txt.bz2", "d.jsonl.zst", "b.jsonl.xz"]
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == ["from_packed"]  # (no decompressed copy left)

    bad = tmp_path / "bad.jsonl.gz"
    bad.write_bytes(gzip.compress(b'{"text": "fine"}\nnot json\n'))
    summary = prepare([str(bad)], str(tmp_path / "bad_out"), workers=1, progress=False)
    assert summary["bad_records"] == 1 and summary["first_bad"] == f"{bad} (decompressed):2: not a JSON line"
    with pytest.raises(PrepareError, match=rf"^{bad} \(decompressed\):2: not a JSON line \(--bad-records stop\)$"):
        prepare([str(bad)], str(tmp_path / "bad_stop"), workers=1, progress=False, bad_records="stop")
    truncated = tmp_path / "cut.jsonl.gz"
    truncated.write_bytes(gzip.compress((corpus / "a.jsonl").read_bytes())[:-100])
    with pytest.raises(PrepareError, match=rf"^{truncated}: cannot decompress \(gzip: "):
        prepare([str(truncated)], str(tmp_path / "cut_out"), workers=1, progress=False)
    assert not (tmp_path / "cut_out").exists() and not (tmp_path / "bad_stop").exists()
    monkeypatch.setitem(prepare_module.COMPRESSED, ".zst", "zstandard_not_installed")
    with pytest.raises(PrepareError, match=r"d\.jsonl\.zst: \.zst input needs zstandard_not_installed; pip install "
                                           r"'titan-lightning\[zstd\]'$"):
        prepare([str(packed)], str(tmp_path / "zst_out"), workers=1, progress=False)
    (tmp_path / "t.parquet.gz").write_bytes(b"x")
    with pytest.raises(PrepareError, match=r"\.parquet extension inside \.gz; prepare reads"):
        prepare([str(tmp_path / "t.parquet.gz")], str(tmp_path / "pq_out"), workers=1, progress=False)


def test_a_file_without_any_text_is_an_error_not_an_empty_set(tmp_path):
    path = _jsonl(tmp_path / "blank.jsonl", [" ", "", "\n"])
    with pytest.raises(PrepareError, match=rf"^{path}: none of its 3 records has text in the field 'text' \(the "
                                           rf"first: {path}:1: no text in 'text'\); name the field with --text-field$"):
        prepare([str(path)], str(tmp_path / "out"), workers=1, progress=False)
    assert not (tmp_path / "out").exists()


def test_the_index_records_the_largest_id_and_a_run_checks_it_against_the_model(tmp_path, monkeypatch):
    from titan_lightning.data import shards as shards_module

    prepare([str(_jsonl(tmp_path / "a.jsonl", DOCS[:20]))], str(tmp_path / "out"), workers=1, progress=False,
            shard_tokens=500)
    largest = int(_tokens(tmp_path / "out").max())
    index = json.loads((tmp_path / "out" / "index.json").read_text())
    assert index["max_id"] == largest and len(index["shards"]) > 2
    ShardSet(tmp_path / "out").check_vocab(largest + 1)
    with pytest.raises(ValueError, match=rf"data.dataset_path='.*out' holds token id {largest} \(the index records "
                                         rf"it\), out of range for model.vocab_size={largest}; use a model with "
                                         rf"vocab_size > {largest}"):
        ShardSet(tmp_path / "out").check_vocab(largest)
    del index["max_id"]  # a set written before the index recorded it: scanned, all of it or a bounded part
    (tmp_path / "out" / "index.json").write_text(json.dumps(index))
    assert ShardSet(tmp_path / "out").max_id() == largest
    monkeypatch.setattr(shards_module, "SCAN_TOKENS", 3 * len(index["shards"]))
    first_three = [ShardSet(tmp_path / "out").read(offset, offset + 3).max() for offset in
                   np.cumsum([0] + [s["tokens"] for s in index["shards"][:-1]])]
    assert ShardSet(tmp_path / "out").max_id() == max(first_three)


@pytest.mark.parametrize("make, message", [
    (lambda d: d / "missing.jsonl", "--input '{d}/missing.jsonl': no such file or folder"),
    (lambda d: (d / "e.jsonl").write_text("") and None or d / "e.jsonl", "{d}/e.jsonl: empty file"),
    (lambda d: (d / "b.txt").write_bytes(b"abc\x00def") and None or d / "b.txt", "{d}/b.txt: binary (a NUL byte at 3)"),
    (lambda d: (d / "x.csv").write_text("a,b") and None or d / "x.csv", "--input '{d}/x.csv': .csv extension"),
    (lambda d: _jsonl(d / "f.jsonl", ["x"], field="content"), "{d}/f.jsonl:1: no text field 'text' (--text-field); "
                                                               "the record has: id, content"),
    (lambda d: (d / "n.jsonl").write_text("[1, 2]\n") and None or d / "n.jsonl", "{d}/n.jsonl:1: no text field 'text'"),
])
def test_bad_input_is_one_line_before_any_work(tmp_path, make, message):
    path = make(tmp_path)
    with pytest.raises(PrepareError, match="^" + message.format(d=tmp_path).replace("(", r"\(").replace(")", r"\)")):
        prepare([str(path)], str(tmp_path / "out"), workers=1, progress=False)
    assert not (tmp_path / "out").exists()


def test_parquet_without_pyarrow_says_which_extra(tmp_path, monkeypatch):
    import builtins

    (tmp_path / "t.parquet").write_bytes(b"PAR1")
    real_import = builtins.__import__
    monkeypatch.setattr(builtins, "__import__", lambda name, *a, **k: (_ for _ in ()).throw(ImportError(name))
                        if name.startswith("pyarrow") else real_import(name, *a, **k))
    with pytest.raises(PrepareError, match=r"t.parquet: Parquet needs pyarrow; pip install 'titan-lightning\[parquet\]'"):
        prepare([str(tmp_path / "t.parquet")], str(tmp_path / "out"), workers=1, progress=False)


def test_parquet_rows_are_documents(tmp_path):
    pa = pytest.importorskip("pyarrow", reason="Parquet support is the optional [parquet] extra")
    import pyarrow.parquet as pq

    table = pa.table({"id": list(range(20)), "content": DOCS[:20]})
    pq.write_table(table, tmp_path / "t.parquet", row_group_size=6)
    prepare([str(tmp_path / "t.parquet")], str(tmp_path / "out"), text_field="content", workers=1, progress=False)
    expected = np.concatenate(load_tokenizer().encode_documents(DOCS[:20]))
    assert np.array_equal(_tokens(tmp_path / "out"), expected)
    assert len(list((tmp_path / "out").glob("*.tokens"))) == 4  # one per row group


def _tokenizer_folder(folder: Path, config: dict, post_processor_bos: bool = False) -> Path:
    from tokenizers import Tokenizer, models, pre_tokenizers, processors

    folder.mkdir()
    vocab = {"<s>": 0, "</s>": 1, "[UNK]": 2, **{c: i + 3 for i, c in enumerate("abcdefghijklmnopqrstuvwxyz ")}}
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tokenizer.pre_tokenizer = pre_tokenizers.Split("", "isolated")
    if post_processor_bos:  # as Llama 3's tokenizer.json: its template puts BOS first
        tokenizer.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 0)])
    tokenizer.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    return folder


@pytest.mark.parametrize("config, post_processor_bos, first", [
    ({"bos_token": "<s>", "eos_token": "</s>", "add_bos_token": True}, False, [0]),  # DeepSeek style
    ({"bos_token": "<s>", "eos_token": "</s>"}, True, [0]),    # Llama 3 style: the post-processor adds BOS
    ({"bos_token": "<s>", "eos_token": "</s>"}, False, []),    # BOS defined, not added
    ({"bos_token": "<s>", "eos_token": "</s>", "add_bos_token": False}, True, []),  # the config's word wins
    ({"eos_token": "</s>"}, False, []),                         # Qwen style: EOS only
])
def test_bos_and_eos_come_from_the_tokenizer_config(tmp_path, config, post_processor_bos, first):
    folder = _tokenizer_folder(tmp_path / "tok", config, post_processor_bos)
    _jsonl(tmp_path / "a.jsonl", ["ab", "c"])
    prepare([str(tmp_path / "a.jsonl")], str(tmp_path / "out"), tokenizer_path=str(folder), workers=1, progress=False)
    a, b, c = 3, 4, 5
    assert _tokens(tmp_path / "out").tolist() == [*first, a, b, 1, *first, c, 1]


def test_the_data_module_trains_on_shards_and_refuses_another_tokenizer(corpus, tmp_path):
    from recipes.tests import features
    from titan_lightning.data.datamodule import TextDataModule

    prepare([str(corpus)], str(tmp_path / "out"), workers=1, progress=False)
    job = features.llama3_debugmodel().job
    job.data.dataset_path = str(tmp_path / "out")
    module = TextDataModule(job)
    module.setup("fit")
    stream = _tokens(tmp_path / "out")
    seq = job.training.seq_len
    batch = next(iter(module.train_dataloader()))
    assert batch["input_ids"].shape == (job.training.microbatch_size, seq)
    for inputs, labels in zip(batch["input_ids"], batch["labels"]):
        window = torch.cat([inputs, labels[-1:]]).numpy()
        positions = [i for i in range(0, len(stream) - seq, seq) if np.array_equal(stream[i:i + seq + 1], window)]
        assert positions, "a training window that is not a window of the shards"
    val = next(iter(module.val_dataloader()))["input_ids"][0].numpy()
    split = ShardSet(tmp_path / "out").document_end_before(int(len(stream) * (1 - job.data.val_fraction)))
    assert np.array_equal(val, stream[split:split + seq])

    other = _tokenizer_folder(tmp_path / "tok", {"eos_token": "</s>"})
    job.data.tokenizer_path = str(other)
    with pytest.raises(ValueError, match=r"were written by another tokenizer .* than data.tokenizer_path"):
        TextDataModule(job).setup("fit")


def test_every_sample_carries_its_document_positions(corpus, tmp_path):
    """position_ids restart at 0 after every EOS of the window (the document boundaries travel
    with the batch), and count from the window's first token for the document it starts inside."""
    from recipes.tests import features
    from titan_lightning.data.datamodule import TextDataModule

    prepare([str(corpus)], str(tmp_path / "out"), workers=1, progress=False)
    job = features.llama3_debugmodel().job
    job.data.dataset_path, job.training.seq_len = str(tmp_path / "out"), 64
    job.training.tokens_per_microbatch_per_dp_rank = 64 * 32
    module = TextDataModule(job)
    module.setup("fit")
    eot = module.tokenizer.eot_id
    batch = next(iter(module.train_dataloader()))
    assert batch["position_ids"].shape == batch["input_ids"].shape
    starts = 0
    for ids, positions in zip(batch["input_ids"].tolist(), batch["position_ids"].tolist()):
        expected, current = [], 0
        for i, token in enumerate(ids):
            expected.append(current)
            current = 0 if token == eot else current + 1
        assert positions == expected
        starts += positions[1:].count(0)
    assert starts > 0  # some windows hold a document boundary


def test_a_shard_set_is_shuffled_in_constant_memory():
    """Each epoch of a shard set is a seeded permutation computed index by index: a bijection
    for any size, another one per epoch and per seed, the same on every call."""
    from titan_lightning.data.dataset import FeistelPermutation

    for n in (1, 2, 3, 5, 64, 65, 1000, 4099):
        order = FeistelPermutation(n, seed=0, epoch=0)
        assert sorted(order[i] for i in range(n)) == list(range(n)), n
    first = [FeistelPermutation(1000, 0, 0)[i] for i in range(1000)]
    assert first == [FeistelPermutation(1000, 0, 0)[i] for i in range(1000)]
    assert first != [FeistelPermutation(1000, 0, 1)[i] for i in range(1000)]
    assert first != [FeistelPermutation(1000, 1, 0)[i] for i in range(1000)]
    assert sum(a == b for a, b in zip(first, range(1000))) < 10  # not near the identity
