"""SFT data (data/sft.py): masked shard sets as packed or padded samples. Packing keeps whole
conversations in corpus order and labels every supervised token once per epoch; labels and
positions token by token; the padded collate cuts padding only; resuming on another data-parallel
size continues exactly; the mask/sft mismatches and missing document masking are one line before
launch."""

import itertools
import json

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from recipes.tests import features
from titan_lightning.config import DataSource
from titan_lightning.data.datamodule import TextDataModule
from titan_lightning.data.sft import ConversationWindows, TrimPadding, pack, sequence_multiple, split_long
from titan_lightning.data.shards import ShardSet
from titan_lightning.models.common.loss import IGNORE_INDEX
from titan_lightning.testing.sft_shards import synthetic_conversations, write_sft_shards

from tests.unit_tests.cpu.test_bad_input import D, assert_refused

I = IGNORE_INDEX
BLOCK = ["--job.model.mask", "block_causal", "--job.model.positions", "per_document"]


@pytest.fixture(scope="module")
def conversations():
    # Lengths of 8 to 65 tokens (those prepare would have cut at seq_len + 1 left out).
    return [c for c in synthetic_conversations(200, seed=1, mean_turn=8, max_turns=2) if len(c[0]) <= 65][:120]


@pytest.fixture(scope="module")
def sft_set(tmp_path_factory, conversations):
    # Shards of ~400 tokens: conversations are read across shard borders.
    return write_sft_shards(tmp_path_factory.mktemp("sft") / "set", conversations, shard_tokens=400)


def _job(path, packing="packed", seq_len=64):
    job = features.llama3_small().job
    job.data.dataset_path, job.data.sft, job.data.sft_packing = str(path), True, packing
    job.model.mask, job.model.positions = "block_causal", "per_document"
    job.training.seq_len, job.training.tokens_per_microbatch_per_dp_rank = seq_len, 4 * seq_len
    return job


def _global_targets(windows: ConversationWindows, index: int) -> list[int]:
    """The span offsets of the tokens window ``index`` labels as supervised."""
    begin, _ = windows.documents(index)
    labels = windows[index]["labels"]
    return [begin + 1 + j for j in torch.nonzero(labels != I).flatten().tolist()]


def test_packing_keeps_whole_conversations_in_order_and_labels_each_supervised_token_once(sft_set, conversations):
    shards = ShardSet(sft_set)
    assert shards.has_mask and len(shards.names) > 3
    ends = np.cumsum([len(t) for t, _ in conversations])
    assert np.array_equal(shards.document_ends(), ends)
    windows = ConversationWindows(shards.tokens, 64, pad_id=0)
    assert windows.first[0] == 0 and windows.first[-1] == len(conversations)
    previous_end = 0
    for k in range(len(windows)):
        begin, window_ends = windows.documents(k)
        assert begin == previous_end  # in corpus order, none skipped, none repeated
        assert set(window_ends) <= set(ends)  # whole conversations: a window ends where one does
        assert window_ends[-1] - begin <= 65
        if k + 1 < len(windows):  # next-fit: the next conversation would not have fitted
            assert windows.documents(k + 1)[1][0] - begin > 65
        previous_end = int(window_ends[-1])
    stream = np.concatenate([t for t, _ in conversations])
    mask = np.concatenate([m for _, m in conversations]).astype(bool)
    mask[np.concatenate([[0], ends[:-1]])] = False  # a conversation's first token: nothing predicts it
    seen = [offset for k in range(len(windows)) for offset in _global_targets(windows, k)]
    assert sorted(seen) == np.flatnonzero(mask).tolist()  # each supervised token, exactly once
    for k in (0, len(windows) - 1):
        sample, (begin, _) = windows[k], windows.documents(k)
        supervised = sample["labels"] != I
        assert torch.equal(sample["labels"][supervised],
                           torch.from_numpy(stream[begin + 1:begin + 65])[supervised[:len(stream) - begin - 1]])


def test_best_fit_holds_every_conversation_once_whole_and_pads_less_than_next_fit(sft_set, conversations):
    shards = ShardSet(sft_set)
    next_fit = ConversationWindows(shards.tokens, 64, pad_id=0)
    windows = ConversationWindows(shards.tokens, 64, pad_id=0, packing="best_fit")
    ends = shards.document_ends()
    spans = [windows.spans(k) for k in range(len(windows))]
    assert sorted(s for w in spans for s in w) == list(zip([0, *ends[:-1].tolist()], ends.tolist()))
    assert all(sum(e - b for b, e in w) <= 65 for w in spans)
    assert len(windows) < len(next_fit)
    stream = np.concatenate([t for t, _ in conversations])
    mask = np.concatenate([m for _, m in conversations]).astype(bool)
    supervised = 0
    for k, w in enumerate(spans):
        sample, at = windows[k], 0
        for b, e in w:  # each conversation's tokens, labels and positions, wherever it sits
            assert sample["input_ids"][at:at + e - b].tolist() == stream[b:e].tolist()[:64 - at]
            assert sample["position_ids"][at:at + e - b].tolist() == list(range(e - b))[:64 - at]
            labels = sample["labels"][at:at + e - b - 1]
            expected = np.where(mask[b + 1:e], stream[b + 1:e], I)[:len(labels)]
            assert labels.tolist() == expected.tolist()
            supervised += int(mask[b + 1:e].sum())
            at += e - b
    assert sum(int((windows[k]["labels"] != I).sum()) for k in range(len(windows))) == supervised
    with pytest.raises(ValueError, match="use spans"):
        windows.documents(0)


def test_best_fit_fills_the_tightest_window_first(tmp_path):
    A, B, C = ([10, 11, 12, 13], [0, 1, 1, 1]), ([20, 21, 22], [0, 1, 1]), ([30, 31, 32, 33, 34, 35], [0] + [1] * 5)
    windows = ConversationWindows(ShardSet(write_sft_shards(tmp_path / "set", [A, B, C])).tokens, 8, pad_id=7,
                                  packing="best_fit")
    # longest first: C opens a window (3 left), A does not fit there (a second window), B fills C's
    assert [windows.spans(k) for k in range(len(windows))] == [[(0, 4)], [(4, 7), (7, 13)]]
    assert windows[1]["input_ids"].tolist() == [20, 21, 22, 30, 31, 32, 33, 34]
    assert windows[1]["position_ids"].tolist() == [0, 1, 2, 0, 1, 2, 3, 4]


def test_labels_and_positions_token_by_token(tmp_path):
    A = ([10, 11, 12, 13], [0, 0, 1, 1])
    B = ([20, 21, 22], [0, 1, 0])
    C = ([30, 31, 32, 33, 34, 35], [0, 0, 0, 1, 1, 0])
    D_ = (list(range(40, 52)), [0] + [1] * 11)  # 12 tokens: longer than the window of 8 + 1
    shards = ShardSet(write_sft_shards(tmp_path / "set", [A, B, C, D_]))
    with pytest.warns(UserWarning, match=r"1 conversation\(s\) .* longer than training.seq_len \+ 1 = 9 tokens"):
        packed = ConversationWindows(shards.tokens, 8, pad_id=7)
    samples = [{k: v.tolist() for k, v in packed[i].items()} for i in range(len(packed))]
    assert samples == [
        # A and B (7 tokens; C would make 13), then padding: a document of its own
        {"input_ids": [10, 11, 12, 13, 20, 21, 22, 7], "labels": [I, 12, 13, I, 21, I, I, I],
         "position_ids": [0, 1, 2, 3, 0, 1, 2, 0]},
        {"input_ids": [30, 31, 32, 33, 34, 35, 7, 7], "labels": [I, I, 33, 34, I, I, I, I],
         "position_ids": [0, 1, 2, 3, 4, 5, 0, 1]},
        # D split into 9 + 3 tokens, each piece a conversation of its own
        {"input_ids": [40, 41, 42, 43, 44, 45, 46, 47], "labels": [41, 42, 43, 44, 45, 46, 47, 48],
         "position_ids": [0, 1, 2, 3, 4, 5, 6, 7]},
        {"input_ids": [49, 50, 51, 7, 7, 7, 7, 7], "labels": [50, 51, I, I, I, I, I, I],
         "position_ids": [0, 1, 2, 0, 1, 2, 3, 4]},
    ]
    with pytest.warns(UserWarning):
        padded = ConversationWindows(shards.tokens, 8, pad_id=7, packing="padded")
    assert [padded[i]["input_ids"].tolist() for i in range(2)] == [[10, 11, 12, 13, 7, 7, 7, 7],
                                                                   [20, 21, 22, 7, 7, 7, 7, 7]]
    assert padded[1]["labels"].tolist() == [21, I, I, I, I, I, I, I]
    assert padded[1]["position_ids"].tolist() == [0, 1, 2, 0, 1, 2, 3, 4]
    assert len(padded) == 5


def test_packing_a_million_conversations_takes_a_fraction_of_a_second():
    import time

    lengths = np.maximum(1, np.random.default_rng(0).lognormal(np.log(300), 0.9, size=1_000_000)).astype(np.int64)
    start = time.perf_counter()
    ends, long = split_long(np.cumsum(lengths), 2049)
    first = pack(ends, 2049)
    assert time.perf_counter() - start < 3  # ~0.2 s on one core
    assert long == int((lengths > 2049).sum()) and first[-1] == len(ends)
    sizes = ends[first[1:] - 1] - np.concatenate([[0], ends[:-1]])[first[:-1]]
    assert sizes.max() <= 2049


def test_padded_collate_cuts_padding_only_and_keeps_the_loss_and_gradients():
    from titan_lightning.models.common.decoder import decoder_class
    from titan_lightning.models.llama3 import Llama3Args

    conversations = [(list(range(1, 1 + n)), [0] * (n // 2) + [1] * (n - n // 2)) for n in (5, 19, 3, 11)]
    samples = []
    for tokens, mask in conversations:
        window = np.asarray(tokens + [0] * (33 - len(tokens)))
        labels = np.where(np.asarray(mask + [0] * (33 - len(mask)))[1:] == 1, window[1:], I)
        positions = np.concatenate([np.arange(len(tokens)), np.arange(33 - len(tokens))])
        samples.append({"input_ids": torch.from_numpy(window[:-1]), "labels": torch.from_numpy(labels),
                        "position_ids": torch.from_numpy(positions[:-1])})
    full = torch.utils.data.default_collate(samples)
    batch = TrimPadding(8)(samples)
    assert batch["input_ids"].shape == (4, 24)  # the longest conversation, 19, rounded up to 8
    assert all(torch.equal(batch[k], full[k][:, :24]) for k in full)
    assert (full["labels"][:, 24:] == I).all()
    assert TrimPadding(24)(samples)["input_ids"].shape == (4, 24)
    assert TrimPadding(32)(samples[2:3])["input_ids"].shape == (1, 32)  # never past seq_len
    whole = {"input_ids": torch.arange(32), "labels": torch.arange(32), "position_ids": torch.arange(32)}
    assert TrimPadding(8)([samples[2], whole])["input_ids"].shape == (2, 32)  # a row without padding

    args = Llama3Args(vocab_size=64, dim=32, n_layers=2, n_heads=4, n_kv_heads=2, max_seq_len=64)
    model = decoder_class(Llama3Args)(args)
    model.init_weights(seed=0)
    model.double()
    grads = []
    for b in (full, batch):
        model.zero_grad()
        loss = F.cross_entropy(model(b["input_ids"]).flatten(0, 1), b["labels"].flatten(), ignore_index=I)
        loss.backward()
        grads.append((loss.detach(), [p.grad.clone() for p in model.parameters()]))
    torch.testing.assert_close(grads[0][0], grads[1][0], rtol=0, atol=1e-12)
    for a, b in zip(grads[0][1], grads[1][1]):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-12)


def test_padded_batches_round_to_what_context_and_sequence_parallelism_split():
    assert sequence_multiple(64, divisor=1, pp=1) == 8
    assert sequence_multiple(96, divisor=6, pp=1) == 24  # cp=3 with the headtail balancer
    assert sequence_multiple(64, divisor=8, pp=1) == 8
    assert sequence_multiple(64, divisor=1, pp=2) == 64  # the pipeline's stage shapes are fixed
    job = _job("x")
    job.parallelism.cp, job.parallelism.tp = 3, 2
    assert job.parallelism.seq_len_divisor == 12


def test_the_data_module_serves_packed_and_padded_batches(sft_set):
    packed = TextDataModule(_job(sft_set))
    packed.check_inputs()
    packed.setup("fit")
    batch = next(iter(packed.train_dataloader()))
    assert set(batch) == {"input_ids", "labels", "position_ids"} and batch["input_ids"].shape == (4, 64)
    val = list(packed.val_dataloader())
    assert val and all((b["labels"] != I).any() for b in val)  # validation scores supervised tokens only
    padded = TextDataModule(_job(sft_set, "padded"))
    padded.setup("fit")
    for batch in itertools.islice(padded.train_dataloader(), 5):
        width = batch["input_ids"].shape[1]
        assert width % 8 == 0 and width <= 64 and batch["labels"].shape == batch["position_ids"].shape
    job = _job(sft_set)
    job.data.dataset_path, job.data.sources = None, [DataSource(path=str(sft_set), name="a"),
                                                     DataSource(path=str(sft_set), name="b", weight=2)]
    mixture = TextDataModule(job)
    mixture.setup("fit")
    assert next(iter(mixture.train_dataloader()))["input_ids"].shape == (4, 64)
    assert len(mixture._val) == 2 * len(packed._val)  # every source's conversations are validated


def _samples(datamodule, n):
    batches = itertools.islice(datamodule.train_dataloader(), -(-n // 4))
    rows = [tuple(row) for b in batches for row in b["input_ids"].tolist()]
    return rows[:n]


def test_an_epoch_visits_every_window_once_and_a_resume_on_another_dp_size_continues_exactly(sft_set, monkeypatch):
    single = TextDataModule(_job(sft_set))
    single.setup("fit")
    n = len(single._train)
    reference = _samples(single, 2 * n + 12)  # two epochs and a bit
    windows = sorted(tuple(single._train[i]["input_ids"].tolist()) for i in range(n))
    assert sorted(reference[:n]) == windows and reference[:n] != reference[n:2 * n]

    def on(dp, rank, state=None):
        datamodule = TextDataModule(_job(sft_set))
        monkeypatch.setattr(datamodule, "_dp", lambda: (dp, rank))
        datamodule.setup("fit")
        if state is not None:
            datamodule.load_state_dict(state)
        return datamodule

    # 2 ranks trained 4 samples each, mid-epoch; 4 ranks resume from global sample 8.
    before = [_samples(on(2, r), 4) for r in range(2)]
    assert [before[g % 2][g // 2] for g in range(8)] == reference[:8]
    after = [_samples(on(4, r, {"consumed_samples": 4, "seed": 0, "dp_size": 2}), -(-(2 * n + 4) // 4))
             for r in range(4)]
    assert [after[g % 4][g // 4] for g in range(2 * n + 4)] == reference[8:2 * n + 12]


@pytest.fixture(scope="module")
def inputs(tmp_path_factory, conversations):
    root = tmp_path_factory.mktemp("sft_inputs")
    write_sft_shards(root / "sft_shards", conversations)
    write_sft_shards(root / "plain_shards", conversations, loss_mask=False)
    write_sft_shards(root / "no_mask_file", conversations)
    (root / "no_mask_file" / "part-00000-00000.mask").unlink()
    return root


CASES = [
    ("sft packed without document masking", [*D, "--job.data.sft", "true", "--job.data.dataset_path", "sft_shards"],
     "model.mask='causal' and model.positions='global' must be 'block_causal' and 'per_document' "
     "(--job.model.mask block_causal --job.model.positions per_document), or set data.sft_packing='padded'"),
    ("sft packing unknown", [*D, "--job.data.sft_packing", "stacked"],
     "data.sft_packing='stacked' is not one of packed, best_fit, padded"),
    ("sft with repeat_to_fit", [*D, *BLOCK, "--job.data.sft", "true", "--job.data.repeat_to_fit", "true"],
     "data.repeat_to_fit=True with data.sft=True"),
    ("sft on shards without masks", [*D, *BLOCK, "--job.data.sft", "true", "--job.data.dataset_path", "plain_shards"],
     "data.dataset_path='plain_shards' is a shard set without loss masks, and data.sft=True trains on the loss mask "
     "of SFT data; prepare it with --chat / --prompt-field, or set data.sft false"),
    ("sft on a text corpus", [*D, "--job.data.sft", "true", "--job.data.sft_packing", "padded"],
     "is a text corpus, and data.sft=True trains on the loss mask of SFT data"),
    ("sft shards without sft", [*D, "--job.data.dataset_path", "sft_shards"],
     "data.dataset_path='sft_shards' is an SFT shard set (it has loss masks), and data.sft=False would train on every "
     "token of it; set --job.data.sft true, or prepare without --chat"),
    ("sft mixture with a source without masks", [*D, *BLOCK, "--job.data.sft", "true", "--job.data.sources",
                                                 json.dumps([{"path": "sft_shards"}, {"path": "plain_shards"}])],
     "data.sources[1].path='plain_shards' is a shard set without loss masks"),
    ("mixture with an sft source", [*D, "--job.data.sources",
                                    json.dumps([{"path": "plain_shards"}, {"path": "sft_shards"}])],
     "data.sources[1].path='sft_shards' is an SFT shard set"),
    ("sft shards missing a mask file", [*D, *BLOCK, "--job.data.sft", "true", "--job.data.dataset_path",
                                        "no_mask_file"],
     "data.dataset_path='no_mask_file': part-00000-00000.mask holds None bytes, the index says"),
]


@pytest.mark.parametrize("name, argv, message", CASES, ids=[c[0].replace(" ", "_") for c in CASES])
def test_bad_sft_input_is_one_line_exit_2_nothing_written(name, argv, message, inputs, capfd, monkeypatch):
    assert_refused(name, argv, message, inputs, capfd, monkeypatch)
