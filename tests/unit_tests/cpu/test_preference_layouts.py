"""Preference training on every layout (#49): what the features suite's DPO entries (llama3_dpo_*:
dp_shard 2 with accumulation, tp 2, cp 2, pp 2, each equal to the one-process run, in both lanes)
rest on, checked here without launching ranks: a window's preference slots are not sliced by
context parallelism, a deterministic run's kept reference is its layout's own, and the fake
group's is never kept."""

import math
import shutil
from dataclasses import replace

import numpy as np
import pytest
import torch


def test_context_parallelism_slices_a_window_s_tokens_and_keeps_its_pair_slots_whole():
    from titan_lightning.parallel.context import ContextParallel
    from titan_lightning.strategies.sharding import shard_sequence

    tokens = torch.arange(16).view(2, 8)
    batch = {"input_ids": tokens, "labels": tokens + 1, "sequence_ids": tokens % 3,
             "sequence_docs": torch.tensor([[0, 1, 2, 3], [4, 5, -1, -1]])}
    for rank, held in ((0, [0, 1, 6, 7]), (1, [2, 3, 4, 5])):
        (sliced, index), = [shard_sequence(ContextParallel(group=None, rank=rank, size=2), (batch, 7))]
        assert index == 7
        for name in ("input_ids", "labels", "sequence_ids"):
            assert torch.equal(sliced[name], batch[name][:, held]), name
        assert torch.equal(sliced["sequence_docs"], batch["sequence_docs"])  # every rank finds each slot's document


def test_a_deterministic_run_keeps_the_reference_of_its_own_layout():
    """A layout sums in its own order: a deterministic run reads only the reference its layout
    computed, so it repeats bit for bit; other runs share one reference of the same weights."""
    from recipes.tests import features
    from titan_lightning.objectives.preference import reference_cache

    names = ("llama3_dpo", "llama3_dpo_accumulation", "llama3_dpo_tp2", "llama3_dpo_pp2")
    jobs = {name: getattr(features, name)().job for name in names}
    assert all(job.training.deterministic for job in jobs.values())
    assert len({reference_cache(job) for job in jobs.values()}) == len(names)
    assert reference_cache(features.llama3_dpo().job) == reference_cache(jobs["llama3_dpo"])
    for job in jobs.values():
        job.training.deterministic = False
    assert len({reference_cache(job) for job in jobs.values()}) == 1


def test_a_fake_group_run_neither_reads_nor_writes_the_kept_reference(tmp_path, monkeypatch):
    """Under the fake group a rank's sums are its own part only: no reference to keep, and a kept
    one is not read (here planted zeros, which would move step 1 off DPO's log 2)."""
    from recipes.tests import features
    from titan_lightning.data.shards import ShardSet
    from titan_lightning.objectives.preference import REFERENCE_FOLDER, reference_cache
    from titan_lightning.testing import worker
    from titan_lightning.trainer import RUN_DIR_ENV

    recipe = "llama3_dpo_fsdp2_accumulation"
    job = getattr(features, recipe)().job
    pairs = shutil.copytree(job.data.dataset_path, tmp_path / "pairs", ignore=shutil.ignore_patterns(REFERENCE_FOLDER))
    kept = reference_cache(replace(job, data=replace(job.data, dataset_path=str(pairs))))
    kept.parent.mkdir()
    np.save(kept, np.zeros(ShardSet(pairs).index["documents"], dtype=np.float32))
    monkeypatch.setenv(RUN_DIR_ENV, str(tmp_path / "run"))
    report = worker.run_command(["fit", "--recipe", f"recipes.tests.features:{recipe}", "--trainer.accelerator", "cpu",
                                 "--trainer.devices", "1", "--trainer.strategy", "FakePGStrategy",
                                 "--trainer.strategy.world_size", "2", "--trainer.max_steps", "1",
                                 "--job.data.dataset_path", str(pairs)])
    assert report["losses"][0] == pytest.approx(math.log(2), abs=1e-6)
    assert list(kept.parent.iterdir()) == [kept]


@pytest.mark.parametrize("recipe", ["llama3_dpo_cp2_ring", "llama3_dpo_pp2"])
def test_a_preference_layout_is_estimated_with_pair_batches(recipe):
    """The dry run's step holds a batch of pairs (each sequence's slot, its reference) through the pair loss."""
    from recipes.tests import features
    from titan_lightning.estimate import estimate

    memory = estimate(getattr(features, recipe)(), world_size=2, rank=1)
    assert memory.activations > 0 and memory.gradients > 0
