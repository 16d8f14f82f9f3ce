"""Corpus text files: documents separated by ``<|endoftext|>``, and the train/val split by documents
(no torch here: ``titan-lightning prepare`` and its workers import this)."""

from pathlib import Path
from typing import Sequence

EOT = "<|endoftext|>"
DOC_SEPARATOR = f"\n\n{EOT}\n\n"


def format_corpus(documents: Sequence[str]) -> str:
    """The text of a corpus file holding ``documents``; ``read_documents`` reads them back."""
    return DOC_SEPARATOR.join(documents) + "\n"


def read_documents(path: Path) -> list[str]:
    """The non-empty documents of a corpus file, stripped of surrounding whitespace.

    Raises ValueError (FileNotFoundError where it does not exist) naming ``data.dataset_path``
    for a folder, an unreadable or empty file, and a file that is not UTF-8 text."""
    field = f"data.dataset_path={str(path)!r}"
    if not path.exists():
        raise FileNotFoundError(f"{field}: no such file")
    if not path.is_file():
        raise ValueError(f"{field} is not a file; give a UTF-8 text file with documents separated by {EOT!r}, "
                         f"or a token shard folder (titan-lightning prepare)")
    try:
        data = path.read_bytes()
    except OSError as err:
        raise ValueError(f"{field} cannot be read ({err.strerror}); give a file this user may read") from None
    if not data.strip():
        raise ValueError(f"{field} is empty; give a UTF-8 text file with documents separated by {EOT!r}")
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as err:
        raise ValueError(f"{field} is not UTF-8 text (byte {err.start}: {err.reason}); give a text corpus") from None
    if "\x00" in text:
        raise ValueError(f"{field} is not text (a NUL byte at character {text.index(chr(0))}); give a text corpus")
    return [doc.strip() for doc in text.split(EOT) if doc.strip()]


def split_documents(documents: Sequence[str], val_fraction: float) -> tuple[list[str], list[str]]:
    """(train, val): val is the shortest tail of documents holding >= val_fraction of the characters."""
    if len(documents) < 2:
        raise ValueError(
            f"the corpus holds {len(documents)} document(s); the train/val split is by documents, "
            f"so it needs at least 2, separated by {EOT!r}"
        )
    wanted = val_fraction * sum(len(doc) for doc in documents)
    held_out, n_val = 0, 0
    while held_out < wanted and n_val < len(documents) - 1:
        n_val += 1
        held_out += len(documents[-n_val])
    return list(documents[:-n_val]), list(documents[-n_val:])
