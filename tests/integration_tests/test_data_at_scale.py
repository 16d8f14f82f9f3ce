"""A user's corpus end to end: JSONL and text -> `titan-lightning prepare` -> a weighted mixture of
the two shard sets -> fit on 4 gloo ranks, killed in a save, resumed on 4 ranks (steps 3-5 bitwise
those of the uninterrupted run) and on 2 data-parallel ranks (the same samples: the mixture's
global sequence does not depend on the data-parallel size; 1e-5, FSDP sums in another order)."""

import json
import math

import pytest

from titan_lightning.testing.faults import FAULT_ENV
from titan_lightning.data.prepare import prepare
from titan_lightning.data.tokenizer import reference_documents
from titan_lightning.testing.launch import LaunchFailed, launch
from titan_lightning.trainer import RUN_DIR_ENV

pytestmark = [pytest.mark.multi_process, pytest.mark.slow]


def _fit(recipe: str, world: int, out, run_dir, sources: str, *extra, env=None) -> dict:
    argv = ["fit", "--recipe", f"recipes.tests.features:{recipe}", "--trainer.accelerator", "cpu",
            "--trainer.devices", str(world), "--job.data.sources", sources, "--job.data.val_fraction", "0.1", *extra]
    return launch(argv, world, out_dir=out, timeout=300, env={RUN_DIR_ENV: str(run_dir), **(env or {})}).ranks[0]


def test_prepared_mixture_trains_on_4_ranks_and_resumes_after_a_kill_on_2(tmp_path):
    docs = reference_documents()
    with (tmp_path / "web.jsonl").open("w") as f:
        for i, doc in enumerate(docs[:45]):
            f.write(json.dumps({"url": f"https://example.org/{i}", "body": doc}) + "\n")
    (tmp_path / "books.txt").write_text("\n<|endoftext|>\n".join(docs[45:]))
    prepare([str(tmp_path / "web.jsonl")], str(tmp_path / "web"), text_field="body", workers=2, progress=False)
    prepare([str(tmp_path / "books.txt")], str(tmp_path / "books"), workers=1, progress=False)
    sources = json.dumps([{"path": str(tmp_path / "web"), "weight": 3}, {"path": str(tmp_path / "books"), "weight": 1}])

    straight = _fit("llama3_fsdp4", 4, tmp_path / "straight", tmp_path / "straight_run", sources)
    assert straight["steps"] == [1, 2, 3, 4, 5]
    saving = ["--trainer.enable_checkpointing", "true", "--job.checkpoint.interval", "2"]
    with pytest.raises(LaunchFailed):  # killed as the second save (step 4) begins
        _fit("llama3_fsdp4", 4, tmp_path / "killed", tmp_path / "run", sources, *saving, env={FAULT_ENV: "2:begin"})
    step2 = str(tmp_path / "run" / "checkpoints" / "epoch=0-step=2.ckpt")
    same = _fit("llama3_fsdp4", 4, tmp_path / "same", tmp_path / "run4", sources, "--job.checkpoint.resume_from", step2)
    assert (same["steps"], same["losses"], same["grad_norms"]) == (
        [3, 4, 5], straight["losses"][2:], straight["grad_norms"][2:])  # bitwise on the same layout
    resumed = _fit("llama3_fsdp2", 2, tmp_path / "resumed", tmp_path / "run2", sources, "--job.checkpoint.resume_from", step2)
    assert resumed["steps"] == [3, 4, 5]
    # The same samples in the same order; FSDP over 2 instead of 4 ranks sums in another order.
    for got, want in zip(resumed["losses"] + resumed["grad_norms"], straight["losses"][2:] + straight["grad_norms"][2:]):
        assert math.isclose(got, want, rel_tol=1e-5), (got, want)
