"""The corpus is tokenized once per process (and once for the ranks the test fork server starts):
the memo answers only while the corpus file, the tokenizer file and the split are unchanged."""

import os

import numpy as np
import pytest

from titan_lightning.data import datamodule
from titan_lightning.data.dataset import EOT, read_documents, split_documents, tokenize_documents
from titan_lightning.data.datamodule import tokenized_splits
from titan_lightning.data.tokenizer import TOKENIZER_PATH, load_tokenizer


@pytest.fixture
def corpus(tmp_path):
    path = tmp_path / "corpus.txt"
    path.write_text(EOT.join(f"document {i}: " + "word " * (i + 3) for i in range(40)))
    return path


def counting():
    calls = []

    def load():
        calls.append(1)
        return load_tokenizer()

    return calls, load


def test_a_second_read_is_the_first_ones_streams_without_tokenizing(corpus):
    calls, load = counting()
    first = tokenized_splits(corpus, None, 0.1, load)
    second = tokenized_splits(corpus, None, 0.1, load)
    assert len(calls) == 1
    train, val = split_documents(read_documents(corpus), 0.1)
    assert np.array_equal(first["train"], tokenize_documents(train, load_tokenizer()))
    assert np.array_equal(first["val"], tokenize_documents(val, load_tokenizer()))
    assert all(second[name] is first[name] for name in ("train", "val"))
    second["train"] = None  # the caller's dict, not the memo's
    assert tokenized_splits(corpus, None, 0.1, load)["train"] is first["train"]


def test_a_changed_corpus_tokenizer_or_split_is_tokenized_again(corpus, tmp_path):
    calls, load = counting()
    before = tokenized_splits(corpus, None, 0.1, load)
    tokenized_splits(corpus, None, 0.2, load)  # another split
    assert len(calls) == 2
    corpus.write_text(corpus.read_text() + EOT + "one more document")  # another size and mtime
    after = tokenized_splits(corpus, None, 0.1, load)
    assert len(calls) == 3 and len(after["train"]) + len(after["val"]) > len(before["train"]) + len(before["val"])
    copy = tmp_path / "tokenizer.json"  # the same tokenizer in another file: another key
    copy.write_bytes(TOKENIZER_PATH.read_bytes())
    tokenized_splits(corpus, str(copy), 0.1, load)
    assert len(calls) == 4
    stat = corpus.stat()  # rewritten with the same size: the modification time tells
    corpus.write_text(corpus.read_text().replace("document 1:", "document X:"))
    os.utime(corpus, ns=(stat.st_atime_ns, stat.st_mtime_ns + 1_000_000))
    assert not np.array_equal(tokenized_splits(corpus, None, 0.1, load)["train"], after["train"])
    assert len(calls) == 5


def test_only_the_newest_few_are_kept(tmp_path):
    calls, load = counting()
    paths = []
    for i in range(datamodule._TOKENIZED_KEPT + 1):
        paths.append(tmp_path / f"c{i}.txt")
        paths[-1].write_text(EOT.join(["alpha beta", "gamma delta", f"corpus {i}"] * 10))
        tokenized_splits(paths[-1], None, 0.1, load)
    kept = {key[0][0] for key in datamodule._TOKENIZED}
    assert str(paths[0].resolve()) not in kept and str(paths[-1].resolve()) in kept


def test_errors_still_name_the_field(tmp_path):
    with pytest.raises(FileNotFoundError, match=r"data.dataset_path='.*nope.txt': no such file"):
        tokenized_splits(tmp_path / "nope.txt", None, 0.1, load_tokenizer)
    with pytest.raises(FileNotFoundError, match=r"data.tokenizer_path='.*none.json': no such file"):
        tokenized_splits(tmp_path / "nope.txt", str(tmp_path / "none.json"), 0.1, load_tokenizer)
