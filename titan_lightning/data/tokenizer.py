"""The byte-level BPE tokenizer, and the shipped test assets it is trained on.

Rebuild the corpus and the tokenizer (deterministic for a given Python version)::

    python -m titan_lightning.data.tokenizer
"""

import json
import platform
from pathlib import Path
from typing import Any, Optional, Sequence

import numpy as np
from tokenizers import Encoding
from tokenizers import Tokenizer as HFTokenizer
from tokenizers import decoders, models, pre_tokenizers, trainers

from titan_lightning.config import DataConfig
from titan_lightning.data.text import EOT, format_corpus, split_documents

VOCAB_SIZE = 2048
# Package data: the corpus and tokenizer every recipe uses by default (installed with the package).
SHIPPED_DIR = Path(__file__).resolve().parents[1] / "assets"
CORPUS_PATH = SHIPPED_DIR / "corpus" / "python_reference.txt"
TOKENIZER_PATH = SHIPPED_DIR / "tokenizer" / "tokenizer.json"
# The test suites' assets (goldens, schedules): in a checkout only.
ASSETS_DIR = Path(__file__).resolve().parents[2] / "tests" / "assets"
REBUILD_COMMAND = "python -m titan_lightning.data.tokenizer"


def shipped_asset(path: Path) -> Path:
    """``path`` if it exists, else an error that says how to rebuild the shipped assets."""
    if not path.is_file():
        raise FileNotFoundError(f"shipped asset {str(path)!r} is missing; rebuild it with `{REBUILD_COMMAND}`")
    return path


def _special_token(value: Any) -> Optional[str]:
    """A tokenizer_config.json special token: a string, or an object with its ``content``."""
    return value.get("content") if isinstance(value, dict) else value


class Tokenizer:
    """A `tokenizers` tokenizer seen as ``str <-> list[int]``, with its end-of-text id.

    ``special_tokens`` are those of a Hugging Face tokenizer_config.json (``eos_token``,
    ``bos_token``): the end of each document is ``eos_token`` when it names one, else
    ``<|endoftext|>``.
    """

    def __init__(self, tokenizer: HFTokenizer, special_tokens: Optional[dict[str, Any]] = None) -> None:
        special = special_tokens or {}
        self.eot_token: str = _special_token(special.get("eos_token")) or EOT
        eot_id = tokenizer.token_to_id(self.eot_token)
        if eot_id is None:
            raise ValueError(f"the tokenizer has no {self.eot_token!r} token")
        self.bos_token: Optional[str] = _special_token(special.get("bos_token"))
        self.bos_id: Optional[int] = tokenizer.token_to_id(self.bos_token) if self.bos_token else None
        # Each document starts with BOS when tokenizer_config.json says so (add_bos_token), or,
        # without that key, when the tokenizer's own post-processor puts it first.
        adds = special.get("add_bos_token")
        if adds is None:
            adds = self.bos_id is not None and tokenizer.encode("a", add_special_tokens=True).ids[:1] == [self.bos_id]
        self.add_bos: bool = bool(adds) and self.bos_id is not None
        self._tokenizer = tokenizer
        self.eot_id: int = eot_id
        self.vocab_size: int = tokenizer.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str) -> list[int]:
        return self._tokenizer.encode(text, add_special_tokens=False).ids

    def encode_batch(self, texts: Sequence[str]) -> list[list[int]]:
        return [e.ids for e in self._tokenizer.encode_batch(list(texts), add_special_tokens=False)]

    def encode_encodings(self, texts: Sequence[str]) -> list[Encoding]:
        """Each text's `tokenizers` Encoding (nothing added): its ids and where each is in the text
        (``offsets``, ``char_to_token``, ``token_to_chars``)."""
        return self._tokenizer.encode_batch(list(texts), add_special_tokens=False)

    def special_tokens(self) -> list[str]:
        """The text of the tokenizer's special added tokens (``<|eot_id|>``, ``<|im_end|>``, ...)."""
        return [t.content for t in self._tokenizer.get_added_tokens_decoder().values() if t.special]

    def encode_documents(self, texts: Sequence[str]) -> list[np.ndarray]:
        """Each text as one document: [BOS when ``add_bos``] + its ids + EOS, int64."""
        head = [self.bos_id] if self.add_bos else []
        return [np.array([*head, *ids, self.eot_id], dtype=np.int64) for ids in self.encode_batch(texts)]

    def decode(self, ids: Sequence[int]) -> str:
        return self._tokenizer.decode(list(ids), skip_special_tokens=False)


def tokenizer_file(path: Optional[str] = None) -> Path:
    """The `tokenizers` JSON file ``data.tokenizer_path`` names: the file, ``tokenizer.json`` in a
    folder (as Hugging Face saves one), or the shipped one for None. Errors name the field."""
    if path is None:
        return shipped_asset(TOKENIZER_PATH)
    field = f"data.tokenizer_path={path!r}"
    file = Path(path)
    if file.is_dir():
        file = file / "tokenizer.json"
        if not file.is_file():
            raise FileNotFoundError(f"{field} is a folder without tokenizer.json; give a `tokenizers` JSON file")
    elif not file.exists():
        raise FileNotFoundError(f"{field}: no such file")
    return file


def load_tokenizer(path: Optional[str] = None) -> Tokenizer:
    """The tokenizer in the `tokenizers` JSON file ``path`` (or a folder holding ``tokenizer.json``,
    as Hugging Face saves one); None is the shipped one. Errors name ``data.tokenizer_path``."""
    file = tokenizer_file(path)
    if path is None:
        return Tokenizer(HFTokenizer.from_file(str(file)))
    field = f"data.tokenizer_path={path!r}"
    try:
        tokenizer = HFTokenizer.from_file(str(file))
    except Exception as err:  # noqa: BLE001 - tokenizers raises a bare Exception for any bad file
        reason = " ".join(str(err).split())[:200]
        raise ValueError(f"{field} is not a `tokenizers` JSON file (tokenizer.json) ({reason})") from None
    try:
        return Tokenizer(tokenizer, read_tokenizer_config(file.parent / "tokenizer_config.json", field))
    except ValueError as err:
        raise ValueError(f"{field}: {err}") from None


def read_tokenizer_config(path: Path, field: str) -> dict[str, Any]:
    """The Hugging Face tokenizer_config.json next to a tokenizer.json, or {} without one."""
    if not path.is_file():
        return {}
    try:
        config = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, ValueError) as err:
        raise ValueError(f"{field}: {path} is not a JSON file ({' '.join(str(err).split())[:200]})") from None
    return config if isinstance(config, dict) else {}


def train_tokenizer(documents: Sequence[str], vocab_size: int = VOCAB_SIZE) -> HFTokenizer:
    """A byte-level BPE (GPT-2 style) with ``<|endoftext|>`` as its only special token."""
    tokenizer = HFTokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[EOT],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(documents, trainer=trainer, length=len(documents))
    return tokenizer


def reference_documents() -> list[str]:
    """The topic texts of this Python's reference manual (``pydoc_data``), sorted by topic."""
    from pydoc_data.topics import topics

    return [topics[name].strip() for name in sorted(topics)]


def build_assets(corpus_path: Path = CORPUS_PATH, tokenizer_path: Path = TOKENIZER_PATH) -> None:
    """Write the corpus and the tokenizer trained on its train split (default ``val_fraction``)."""
    documents = reference_documents()
    corpus_path.parent.mkdir(parents=True, exist_ok=True)
    corpus_path.write_bytes(format_corpus(documents).encode("utf-8"))
    train, _ = split_documents(documents, DataConfig().val_fraction)
    tokenizer_path.parent.mkdir(parents=True, exist_ok=True)
    train_tokenizer(train).save(str(tokenizer_path))


if __name__ == "__main__":
    build_assets()
    print(f"wrote {CORPUS_PATH} and {TOKENIZER_PATH} from Python {platform.python_version()}'s pydoc_data")


def check_token_ids(ids: np.ndarray, largest: Optional[int], file: Path, offset: int = 0) -> None:
    """Token ids read from a shard (``file``, from its token ``offset``) are at most ``largest``,
    the largest id its index records (checked against the model's vocabulary before launch): a
    file changed after prepare is named here, not met as an IndexError in the embedding."""
    if largest is None or not len(ids):
        return
    top = int(ids.max())
    if top > largest:
        raise ValueError(f"{file} holds token id {top} (its token {offset + int(np.argmax(ids))}), above the largest "
                         f"id its index.json records ({largest}): the file changed after prepare; prepare the shard "
                         f"set again")


def scan_token_ids(shards, tokens: int = 2**24) -> None:
    """Before launch: ``tokens`` of the ``ShardSet`` (the first of each shard, all of a small set)
    read, so that the check of every read (``check_token_ids``) names an edited file before the run."""
    each = max(tokens // max(len(shards.names), 1), 1)
    for k in range(len(shards.names)):
        stop = min(shards.offsets[k + 1], shards.offsets[k] + each)
        for start in range(shards.offsets[k], stop, 2**22):
            shards.read(start, min(start + 2**22, stop))
