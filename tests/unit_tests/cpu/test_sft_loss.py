"""Loss-masked training (``data.sft``): the loss is the sum over supervised tokens divided by the
supervised tokens of the whole optimizer step, on every layout. The batches (sft_loss_cases.py)
give the microbatches very different numbers of supervised tokens (3, 59, 0 and 11 of 64), so a
mean per microbatch would not match one batch. Masked targets change nothing; supervised ones do.
The parallel layouts (FSDP2, FSDP2 x TP2, CP2, PP2, EP2, accumulation) are entries of the
integration suites (the llama3_sft_* features, qwen3_moe_sft_fsdp2_ep2); sft_loss_cases.sft_run
also runs on 2 ranks through titan_lightning.testing.spawn for debugging a layout alone."""

from pathlib import Path

import pytest

import sft_loss_cases as cases

RTOL = 2e-5


def _assert_same(got: dict, want: dict, rtol: float = RTOL) -> None:
    """Losses and the gradients of the parameters ``got``'s rank holds (a pipeline stage's only)."""
    assert len(got["steps"]) == len(want["steps"])
    for g, w in zip(got["steps"], want["steps"]):
        assert abs(g["loss"] - w["loss"]) <= rtol * abs(w["loss"]), (g["loss"], w["loss"])
        assert g["grads"] and set(g["grads"]) <= set(w["grads"])
        for name, values in ((n, w["grads"][n]) for n in g["grads"]):
            # (relative to the tensor's largest value for its small ones: a value cancelled down to 1e-3
            # of its tensor's scale differed by 2.1e-8 between layouts on an AVX-512 host)
            scale = max([abs(v) for v in values] + [1e-3])
            for a, b in zip(g["grads"][name], values):
                assert abs(a - b) <= rtol * max(abs(b), scale), (name, g["grads"][name], values)


@pytest.fixture(scope="module")
def one_process():
    return cases.sft_run()


def test_gradient_accumulation_weighs_microbatches_by_their_supervised_tokens(one_process):
    _assert_same(cases.sft_run(accumulate=2), one_process)
    _assert_same(cases.sft_run(accumulate=4), one_process)


def test_the_chunked_loss_sums_the_same_tokens(one_process):
    _assert_same(cases.sft_run(accumulate=2, loss_chunks=3), one_process)


def test_a_masked_target_changes_nothing_and_a_supervised_one_does(one_process):
    # The last token of a row is a target only (never an input): rows 0, 2 and 3 mask it, row 1
    # supervises it.
    assert cases.sft_run(change_last=(0, 2, 3)) == one_process  # bit-identical: losses and gradients
    changed = cases.sft_run(change_last=(1,))
    for got, want in zip(changed["steps"], one_process["steps"]):
        assert got["loss"] != want["loss"]
        assert got["grads"]["output.weight"] != want["grads"]["output.weight"]


def test_a_step_without_supervised_tokens_stops_the_run_naming_it():
    """Decided: fail. A whole optimizer step whose every label is masked has nothing to learn from;
    its update is empty (gradients zero, not NaN), and the run stops at the next check (the next
    step, a checkpoint, the end of training) before any checkpoint of it, saying why."""
    with pytest.raises(ValueError, match="step 1 had no supervised token on any rank"):
        cases.sft_run(spans=[(0, 0)] * cases.ROWS)


@pytest.mark.parametrize("degrees", [{"tp": 2}, {"cp": 2}], ids=["tp2", "cp2"])
def test_the_logged_supervised_tokens_count_each_token_once(one_process, degrees, tmp_path):
    """TP ranks hold the same labels, CP ranks slices of them: on 2 gloo ranks the logged
    ``train/supervised_tokens`` (and the loss) are the one-process run's."""
    from titan_lightning.testing.launch import pythonpath_env
    from titan_lightning.testing.spawn import run_function

    env = pythonpath_env(Path(__file__).parent)
    ranks = run_function("sft_loss_cases:sft_run", 2, out_dir=tmp_path, timeout=300, env=env,
                         init_process_group=False, degrees=degrees)
    want = [step["supervised_tokens"] for step in one_process["steps"]]
    assert want[0] == sum(b - a for a, b in cases.SPANS)
    for rank in ranks:
        assert [step["supervised_tokens"] for step in rank["steps"]] == want
        _assert_same(rank, one_process)
