"""Weighted mixtures of sources: deterministic, in proportion, the same global sequence on any
number of data-parallel ranks (so a resume onto another size continues exactly), and changed
weights at a resume continue every source where it stopped."""

import numpy as np
import pytest
import torch

from titan_lightning.config import DataConfig
from titan_lightning.data.dataset import TokenWindows
from titan_lightning.data.mixture import MixtureSchedule, MixtureStream


def _sources(sizes=(50, 30, 7), seq_len=4):
    """Source s's window i holds tokens 1000 * s + i * seq_len ..., so a sample names its source and window."""
    return [TokenWindows(np.arange(1000 * s, 1000 * s + n * seq_len + 1), seq_len) for s, n in enumerate(sizes)]


def _ids(samples) -> list[tuple[int, int]]:
    return [(int(x["input_ids"][0]) // 1000, (int(x["input_ids"][0]) % 1000) // 4) for x in samples]


def _take(stream, n):
    it = iter(stream)
    return [next(it) for _ in range(n)]


def test_proportions_within_one_percent_and_the_schedule_is_deterministic():
    weights = [0.6, 0.3, 0.1]
    schedule = MixtureSchedule(weights, seed=0)
    sources = [schedule.locate(p)[0] for p in range(10_000)]
    shares = np.bincount(sources, minlength=3) / 10_000
    assert np.abs(shares - weights).max() < 0.01, shares
    assert sources == [MixtureSchedule(weights, seed=0).locate(p)[0] for p in range(10_000)]
    assert sources != [MixtureSchedule(weights, seed=1).locate(p)[0] for p in range(10_000)]
    # Each source's samples are taken in order, and counts_at agrees with locate.
    seen = np.zeros(3, dtype=int)
    for p in range(3000):
        assert np.array_equal(schedule.counts_at(p), seen)
        s, index = schedule.locate(p)
        assert index == seen[s]
        seen[s] += 1


def test_the_global_sequence_does_not_depend_on_the_data_parallel_size():
    sources, schedule = _sources(), MixtureSchedule([2, 1, 1], seed=3)
    one = _ids(_take(MixtureStream(sources, schedule, seed=3), 240))
    assert {s for s, _ in one} == {0, 1, 2}
    for dp in (2, 4):
        ranks = [_ids(_take(MixtureStream(sources, schedule, seed=3, dp_rank=r, dp_size=dp), 240 // dp)) for r in range(dp)]
        assert [ranks[p % dp][p // dp] for p in range(240)] == one
    # A source shorter than its share wraps around in new epochs, each a permutation of its windows.
    small = [i for s, i in one if s == 2]
    assert sorted(small[:7]) == list(range(7))


def test_resume_onto_another_data_parallel_size_continues_exactly():
    """4 ranks consume 10 samples each; 2 ranks resume at 4 * 10 / 2 = 20 each."""
    sources, schedule = _sources(), MixtureSchedule([1, 1, 3], seed=0)
    full = _ids(_take(MixtureStream(sources, schedule, seed=0), 100))
    resumed = [_ids(_take(MixtureStream(sources, schedule, seed=0, dp_rank=r, dp_size=2, start=20), 30)) for r in range(2)]
    assert [resumed[p % 2][p // 2] for p in range(60)] == full[40:100]


def test_changed_weights_continue_every_source_where_it_stopped(tmp_path):
    from recipes.tests import features
    from titan_lightning.data.datamodule import TextDataModule

    job = features.llama3_debugmodel().job
    job.data = DataConfig(sources=[{"path": "a/", "weight": 1.0}, {"path": "b/", "weight": 1.0}])
    module = TextDataModule(job)
    old = module.schedule()
    saved = {"consumed_samples": 300, "seed": job.training.seed, "dp_size": 1, **module.state_dict()}
    saved["consumed_samples"] = 300
    job.data.sources[1].weight = 3.0
    module.load_state_dict(saved)
    new = module.schedule()
    reached = old.counts_at(300)
    assert np.array_equal(new.counts_at(300), reached)
    firsts = {}
    for p in range(300, 700):
        s, index = new.locate(p)
        firsts.setdefault(s, index)
    assert firsts == {0: reached[0], 1: reached[1]}  # nothing repeated, nothing skipped
    later = np.bincount([new.locate(p)[0] for p in range(300, 4396)], minlength=2) / 4096
    assert abs(later[1] - 0.75) < 0.01
    # The same weights keep the saved schedule: a second resume at another position agrees.
    again = TextDataModule(job)
    again.load_state_dict({**again.state_dict(), "consumed_samples": 500, "mixture": module.state_dict()["mixture"]})
    assert np.array_equal(again.schedule().counts_at(700), new.counts_at(700))
    job.data.sources.append(type(job.data.sources[0])(path="c/"))
    with pytest.raises(ValueError, match="a run with 2 sources in a run with 3 data.sources"):
        TextDataModule(job).load_state_dict(saved)


@pytest.mark.parametrize("sources, message", [
    ([{"path": "a/", "weight": 0}], r"data.sources\[0\].weight=0 \(a/\) must be > 0"),
    ([{"path": "a/", "weight": -1.5}], r"data.sources\[0\].weight=-1.5 \(a/\) must be > 0"),
    ([{"path": "x/a/"}, {"path": "y/a"}], r"data.sources name the sources \['a', 'a'\]; give each a distinct name"),
])
def test_bad_mixtures_are_one_line(sources, message):
    with pytest.raises(ValueError, match=message):
        DataConfig(sources=sources)
    with pytest.raises(ValueError, match="data.sources and data.dataset_path='c.txt' are both set"):
        DataConfig(sources=[{"path": "a/"}], dataset_path="c.txt")


def test_a_mixture_of_shard_sets_trains_in_proportion_and_logs_each_source(tmp_path):
    from recipes.tests import features
    from titan_lightning.data.datamodule import TextDataModule
    from titan_lightning.data.prepare import prepare
    from titan_lightning.data.tokenizer import reference_documents

    docs = reference_documents()
    for name, part in (("prose", docs[:40]), ("more", docs[40:])):
        (tmp_path / f"{name}.txt").write_text("\n<|endoftext|>\n".join(part))
        prepare([str(tmp_path / f"{name}.txt")], str(tmp_path / name), workers=1, progress=False)
    job = features.llama3_debugmodel().job
    job.data = DataConfig(sources=[{"path": str(tmp_path / "prose"), "weight": 1},
                                   {"path": str(tmp_path / "more"), "weight": 4}], val_fraction=0.1)
    module = TextDataModule(job)
    module.setup("fit")
    loader = iter(module.train_dataloader())
    batches = [next(loader) for _ in range(50)]
    assert all(b["input_ids"].shape == (job.training.microbatch_size, job.training.seq_len) for b in batches)
    module._start = 50 * job.training.microbatch_size  # as if Lightning had trained on them
    tokens = module.source_tokens()
    assert sum(tokens.values()) == 50 * job.training.microbatch_size * job.training.seq_len
    counts = module.schedule().counts_at(50 * job.training.microbatch_size)
    assert tokens == {"prose": counts[0] * job.training.seq_len, "more": counts[1] * job.training.seq_len}
    assert 0.7 < tokens["more"] / sum(tokens.values()) < 0.9  # a block's prefix: near the 0.8 share
    assert torch.is_tensor(next(iter(module.val_dataloader()))["input_ids"])


def test_a_source_too_short_for_one_window_is_named_by_its_field(tmp_path):
    from recipes.tests import features
    from titan_lightning.data.datamodule import TextDataModule

    (tmp_path / "tiny.txt").write_text("a b c <|endoftext|> d e f")
    job = features.llama3_debugmodel().job
    job.data = DataConfig(sources=[{"path": str(tmp_path / "tiny.txt")}])
    with pytest.raises(ValueError, match=r"the train split of data.sources\[0\].path='.*tiny.txt'"):
        TextDataModule(job).setup("fit")
