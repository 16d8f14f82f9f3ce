"""SFT shard sets made by hand for tests and benchmarks: tokens, loss mask, document ends and an
index as ``titan-lightning prepare --chat`` writes them (data/shards.py's writer), without a
tokenizer or a chat template.

``write_sft_shards(folder, conversations)`` writes ``(tokens, mask)`` pairs, one conversation per
document; ``synthetic_conversations(n)`` makes conversations of a realistic length mix (a short
system turn, then user and assistant turns of a long-tailed length, the assistant's supervised);
``synthetic_pairs(n)`` preference pairs as ``prepare --preference`` writes them (chosen, then
rejected, each its prompt and its answer).
"""

import os
import shutil
import tempfile
from pathlib import Path
from typing import Any, Optional, Sequence

import numpy as np

from titan_lightning.data.shards import INDEX, ShardWriter, token_dtype, tokenizer_identity, write_index
from titan_lightning.data.tokenizer import load_tokenizer, tokenizer_file


def shipped_tokenizer_identity() -> dict[str, Any]:
    """The identity (data/shards.py) of the shipped tokenizer, which a run without
    ``data.tokenizer_path`` checks a shard set against."""

    tokenizer = load_tokenizer()
    return tokenizer_identity(tokenizer_file(None), tokenizer.vocab_size, tokenizer.eot_id, None)


def write_sft_shards(folder: Path, conversations: Sequence[tuple[Sequence[int], Sequence[int]]], *,
                     tokenizer: Optional[dict[str, Any]] = None, shard_tokens: int = 2**28,
                     loss_mask: bool = True, pairs: bool = False) -> Path:
    """A shard set of ``conversations`` (token ids and a 0/1 mask of the same length each), in
    shards of about ``shard_tokens`` tokens; ``tokenizer``: the identity the index records (default:
    the shipped tokenizer's). ``loss_mask=False`` writes the same tokens as a set without masks;
    ``pairs=True`` marks them preference pairs (``synthetic_pairs``)."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    tokenizer = tokenizer or shipped_tokenizer_identity()
    dtype = token_dtype(tokenizer["vocab_size"])
    writer = ShardWriter(folder, "part-00000", dtype, shard_tokens=shard_tokens)
    for tokens, mask in conversations:
        if len(tokens) != len(mask):
            raise ValueError(f"a conversation of {len(tokens)} tokens with a mask of {len(mask)}")
        writer.add(np.asarray(tokens), np.asarray(mask, dtype=np.uint8) if loss_mask else None)
    sft = {"train_on": "assistant", "max_tokens": None, "too_long": "truncate", "conversations": len(conversations),
           "truncated": 0, "dropped": 0, "chat_template_sha256": None} if loss_mask else None
    if pairs:
        sft["pairs"] = len(conversations) // 2
    write_index(folder, dtype, tokenizer, writer.close(), sft=sft)
    return folder


def synthetic_conversations(n: int, *, seed: int = 0, vocab_size: int = 2048, eos_id: int = 0,
                            mean_turn: int = 24, max_turns: int = 3) -> list[tuple[np.ndarray, np.ndarray]]:
    """``n`` conversations: a system turn of 4-12 tokens, then 1..``max_turns`` user/assistant
    pairs of lognormal lengths around ``mean_turn``, then EOS. The mask is 1 on the assistant's
    tokens and 0 on the rest (the EOS included). Token ids avoid ``eos_id``."""
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(n):
        lengths = [int(rng.integers(4, 13))]
        for _ in range(int(rng.integers(1, max_turns + 1))):
            lengths += [max(1, int(rng.lognormal(np.log(mean_turn), 0.8))) for _ in range(2)]
        mask = np.concatenate([np.full(length, i % 2 == 0 and i > 0, dtype=np.uint8)
                               for i, length in enumerate(lengths)] + [np.zeros(1, np.uint8)])
        tokens = rng.integers(1, vocab_size, size=len(mask))
        tokens[tokens == eos_id] = (eos_id + 1) % vocab_size
        tokens[-1] = eos_id
        out.append((tokens, mask))
    return out


def synthetic_pairs(n: int, *, seed: int = 0, vocab_size: int = 2048, eos_id: int = 0,
                    longest: int = 20) -> list[tuple[np.ndarray, np.ndarray]]:
    """``n`` preference pairs, 2n documents: a prompt of 2-8 tokens, then the chosen answer (1 to
    ``longest`` tokens and EOS, supervised), then the same prompt and the rejected answer (another
    length of the same range): answers of very uneven lengths. Token ids avoid ``eos_id``."""
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(n):
        prompt = rng.integers(1, vocab_size, size=int(rng.integers(2, 9)))
        for length in rng.integers(1, longest + 1, size=2):
            tokens = np.concatenate([prompt, rng.integers(1, vocab_size, size=int(length)), [eos_id]])
            tokens[:-1][tokens[:-1] == eos_id] = (eos_id + 1) % vocab_size
            out.append((tokens, np.concatenate([np.zeros(len(prompt), np.uint8), np.ones(length + 1, np.uint8)])))
    return out


def cached_synthetic_set(n: int = 200, *, seed: int = 0, mean_turn: int = 12, max_turns: int = 2,
                         pairs: bool = False) -> Path:
    """A shard set of ``synthetic_conversations(n)`` (``pairs``: ``synthetic_pairs(n)``) for the
    shipped tokenizer (its ids and EOS), in the system's temporary folder, named by its settings:
    written once, by whichever process of a launch gets there first (written aside, then renamed
    into place), read by the others. The SFT and preference entries of the integration suites train
    on it."""
    tokenizer = load_tokenizer()
    kind = "pairs" if pairs else "sft"
    name = f"titan-lightning-{kind}-v1-{n}-{seed}-{mean_turn}-{max_turns}-{tokenizer.vocab_size}-{tokenizer.eot_id}"
    folder = Path(tempfile.gettempdir()) / name
    if (folder / INDEX).is_file():
        return folder
    staging = folder.with_name(f"{name}.partial-{os.getpid()}")
    if pairs:
        conversations = synthetic_pairs(n, seed=seed, vocab_size=tokenizer.vocab_size, eos_id=tokenizer.eot_id)
    else:
        conversations = synthetic_conversations(n, seed=seed, vocab_size=tokenizer.vocab_size,
                                                eos_id=tokenizer.eot_id, mean_turn=mean_turn, max_turns=max_turns)
    write_sft_shards(staging, conversations, pairs=pairs)
    try:
        os.rename(staging, folder)
    except OSError:  # another process renamed its copy first: the same bytes
        shutil.rmtree(staging, ignore_errors=True)
    return folder
