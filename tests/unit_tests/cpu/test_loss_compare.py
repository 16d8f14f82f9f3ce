"""Seed checkpoints and the loss-compare tool."""

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from safetensors.torch import load_file
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Shard, distribute_tensor

from titan_lightning.parallel.fake import init_fake_process_group
from titan_lightning.recipe import build_run
from titan_lightning.testing import loss_compare
from titan_lightning.testing.hashing import hash_model
from titan_lightning.testing.launch import pythonpath_env
from titan_lightning.testing.seed_checkpoint import create_seed_checkpoint, load_full_state_dict

BASE = "recipes.tests.features:llama3_debugmodel"


def _materialized(seed: int):
    module = build_run(BASE).module
    module.job.training.seed = seed
    with torch.device("meta"):
        module.model = module.build_model()
    module.materialize(torch.device("cpu"))
    return module.model


def test_a_seed_checkpoint_restores_the_recipe_init_into_a_differently_initialized_model(tmp_path):
    path = create_seed_checkpoint(BASE, tmp_path / "seed.safetensors")
    reference, other = _materialized(0), _materialized(1)
    assert hash_model(other) != hash_model(reference)
    load_full_state_dict(other, load_file(str(path)))
    assert hash_model(other) == hash_model(reference)


def test_loading_refuses_missing_keys_and_wrong_shapes_by_name(tmp_path):
    model = _materialized(0)
    state = {k: v.clone() for k, v in model.state_dict().items()}
    name = next(iter(state))
    with pytest.raises(KeyError, match=re.escape(f"missing ['{name}']")):
        load_full_state_dict(model, {k: v for k, v in state.items() if k != name}, source="seed.safetensors")
    state[name] = state[name][:1]
    with pytest.raises(ValueError, match=re.escape(f"seed.safetensors: {name} has shape")):
        load_full_state_dict(model, state, source="seed.safetensors")


def test_loading_shards_full_tensors_into_dtensors_locally():
    init_fake_process_group(rank=1, world_size=2)
    try:
        mesh = init_device_mesh("cpu", (2,))
        holder = torch.nn.Module()
        holder.weight = torch.nn.Parameter(distribute_tensor(torch.zeros(4, 3), mesh, [Shard(0)], src_data_rank=None))
        full = torch.arange(12.0).reshape(4, 3)
        load_full_state_dict(holder, {"weight": full})
        assert torch.equal(holder.weight.to_local(), full[2:])  # rank 1's rows, no communication
    finally:
        dist.destroy_process_group()


def _run(d):
    return {"recipe": "r", "ngpu": 1, "steps": [1, 2], **d}


def test_compare_is_exact_with_rtol_zero_and_names_the_first_difference():
    base = _run({"losses": [8.0, 7.5], "grad_norms": [1.0, 0.9]})
    near = _run({"losses": [8.0, 7.5 * (1 + 1e-7)], "grad_norms": [1.0, 0.9]})
    table, failure = loss_compare.compare(base, near, rtol=0.0)
    assert failure.startswith("step 2: loss differs: baseline 7.5, test 7.50000075")
    assert len(table.splitlines()) == 3
    assert loss_compare.compare(base, near, rtol=1e-6)[1] is None
    assert loss_compare.compare(base, base, rtol=0.0)[1] is None
    _, failure = loss_compare.compare(base, _run({"steps": [1], "losses": [8.0], "grad_norms": [1.0]}), rtol=None)
    assert "different steps" in failure


# Recipe modules written into tmp_path: one whose own import fails, and recipes that raise or return no Run.
RECIPE_MODULES = {
    "lc_import_fails": "import lc_no_such_dependency\n",
    "lc_recipes": "def raises():\n    raise ValueError('no data\\nat all')\n\n\ndef returns_int():\n    return 3\n",
}
EXPORTED = {"recipe": BASE, "ngpu": 1, "steps": [1, 2], "losses": [8.0, 7.5], "grad_norms": [1.0, 0.9]}


@pytest.fixture
def bad_inputs(tmp_path, monkeypatch):
    """tmp_path holding bad recipe modules (importable), bad --import files and a file that is no checkpoint."""
    for name, source in RECIPE_MODULES.items():
        (tmp_path / f"{name}.py").write_text(source)
    monkeypatch.syspath_prepend(str(tmp_path))
    files = {
        "not_safetensors.bin": "hello",
        "not.json": "{",
        "list.json": "[]",
        "no_losses.json": json.dumps({"baseline": {k: v for k, v in EXPORTED.items() if k != "losses"}}),
        "short.json": json.dumps({"baseline": {**EXPORTED, "grad_norms": [1.0]}}),
        "a_file": "x",
    }
    for name, text in files.items():
        (tmp_path / name).write_text(text)
    yield tmp_path
    for name in RECIPE_MODULES:
        sys.modules.pop(name, None)


def _main(argv, capsys) -> tuple[int, str]:
    try:
        status = loss_compare.main(argv)
    except SystemExit as exit:  # argparse's own errors
        status = exit.code
    return status, capsys.readouterr().err


def _refused(argv, out, capsys) -> str:
    """Run the tool on bad input: exit 2, one stderr line, no traceback, --out not created. Returns stderr."""
    status, err = _main([*argv, "--out", str(out)], capsys)
    assert status == 2 and err.count("\n") == 1 and "Traceback" not in err, err
    assert err.startswith("loss_compare: error: ")
    assert not out.exists()
    return err


@pytest.mark.parametrize("argv, message", [
    # argparse's own errors, in one line
    (["--baseline", BASE, "--steps", "abc"], r"argument --steps: invalid int value: 'abc'"),
    (["--baseline", BASE, "--no-such-flag"], r"unrecognized arguments: --no-such-flag"),
    (["--baseline", BASE, "--accelerator", "tpu"], r"argument --accelerator: invalid choice: 'tpu'"),
    # flags against each other
    ([], r"give --baseline RECIPE"),
    (["--baseline", BASE, "--assert-equal", "--rtol", "1e-5"], r"--assert-equal \(exact\) and --rtol conflict"),
    (["--baseline", BASE, "--rtol", "-1"], r"--rtol=-1.0 must be >= 0"),
    (["--baseline", BASE, "--test-ngpu", "0"], r"--test-ngpu=0 must be >= 1"),
    (["--baseline", BASE, "--timeout", "0"], r"--timeout=0.0 must be > 0"),
    (["--baseline", "nocolon"], r"recipe 'nocolon' must look like package.module:function"),
    (["--baseline", BASE, "--seed-checkpoint", "/no/seed", "--no-seed-checkpoint"], r"conflict"),
    (["--baseline", BASE, "--seed-checkpoint", "/no/seed"], r"--seed-checkpoint /no/seed: no such file"),
    (["--import", "{tmp}/a_file", "--baseline-commit", "HEAD", "--test", BASE], r"drop --baseline-commit"),
    (["--import", "{tmp}/a_file"], r"give --test RECIPE to compare with the imported baseline"),
    # files
    (["--baseline", BASE, "--seed-checkpoint", "{tmp}/not_safetensors.bin"],
     r"--seed-checkpoint \S+not_safetensors.bin is not a safetensors file \(.*header"),
    (["--import", "/no/such.json", "--test", BASE], r"--import /no/such.json: no such file"),
    (["--import", "{tmp}/not.json", "--test", BASE],
     r"--import \S+not.json is not JSON \(.+\); give a file written by --export"),
    (["--import", "{tmp}/list.json", "--test", BASE], r"--import \S+list.json has no 'baseline' object"),
    (["--import", "{tmp}/no_losses.json", "--test", BASE],
     r"--import \S+no_losses.json: 'baseline' lacks losses; a file written by --export has recipe, ngpu, steps"),
    (["--import", "{tmp}/short.json", "--test", BASE],
     r"--import \S+short.json: baseline.grad_norms=\[1.0\] must be a list of numbers, one per entry of baseline.steps"),
    (["--baseline", BASE, "--export", "{tmp}"], r"--export \S+ is a folder; give a JSON file path"),
    # commits
    (["--baseline", BASE, "--baseline-commit", "no-such-ref-xyz"],
     r"--baseline-commit 'no-such-ref-xyz' is not a commit of \S+; give a commit, branch or tag"),
    (["--baseline", BASE, "--test-commit", "HEAD~100000"], r"--test-commit 'HEAD~100000' is not a commit"),
    # recipes, loaded before anything is created
    (["--baseline", "lc_no_such_module:debugmodel"], r"--baseline: .*'lc_no_such_module:debugmodel'.*no module named"),
    (["--baseline", "recipes.tests.features:no_such_recipe"],
     r"--baseline: .*has no recipe function 'no_such_recipe'; it defines: .*llama3_debugmodel"),
    (["--baseline", "lc_import_fails:debugmodel"],
     r"--baseline: .*'lc_import_fails:debugmodel'.*lc_no_such_dependency"),
    (["--baseline", "lc_recipes:raises"], r"--baseline: .*'lc_recipes:raises'.*no data at all"),
    (["--baseline", "lc_recipes:returns_int"], r"--baseline: .*'lc_recipes:returns_int' returned int, expected .*Run"),
    (["--baseline", BASE, "--test", "lc_recipes:returns_int"], r"--test: .*'lc_recipes:returns_int' returned int"),
    (["--import", "{tmp}/no_losses.json", "--test", "lc_recipes:raises"], r"'baseline' lacks losses"),  # files first
])
def test_bad_input_exits_2_with_one_line_and_writes_nothing(argv, message, bad_inputs, capsys):
    argv = [a.format(tmp=bad_inputs) for a in argv]
    err = _refused(argv, bad_inputs / "out", capsys)
    assert re.search(message, err), err


def test_an_out_that_is_a_file_or_under_a_file_is_refused_and_the_file_kept(bad_inputs, capsys):
    for out, message in ((bad_inputs / "a_file", "is a file; give a new or existing folder"),
                         (bad_inputs / "a_file" / "out", "cannot create the folder")):
        status, err = _main(["--baseline", BASE, "--out", str(out)], capsys)
        assert status == 2 and err.count("\n") == 1 and f"--out {out}" in err and message in err, err
    assert (bad_inputs / "a_file").read_text() == "x"


@pytest.mark.parametrize("flags, refused_as", [
    (["--baseline-commit", "HEAD", "--test-commit", "HEAD"], None),  # both sides run HEAD's recipe: not loaded here
    (["--baseline-commit", "HEAD"], "--test"),  # the test side runs this checkout's recipe
    (["--test-commit", "HEAD"], "--baseline"),
])
def test_only_recipes_that_run_from_this_checkout_are_loaded_before_launch(flags, refused_as, bad_inputs):
    args = loss_compare.build_parser().parse_args(["--baseline", "lc_recipes:raises", *flags])
    if refused_as is None:
        assert loss_compare.validate(args) is None
    else:
        with pytest.raises(loss_compare.CompareError, match=f"^{refused_as}: .*'lc_recipes:raises'"):
            loss_compare.validate(args)


def test_the_script_reports_a_bad_flag_in_one_line_and_exit_2(tmp_path):
    script = Path(loss_compare.REPO) / "scripts" / "loss_compare.py"
    done = subprocess.run([sys.executable, str(script), "--steps", "abc", "--out", str(tmp_path / "out")],
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 2
    assert done.stderr == "loss_compare: error: argument --steps: invalid int value: 'abc'\n"
    assert not (tmp_path / "out").exists()


@pytest.mark.slow
@pytest.mark.multi_process
def test_fsdp2_matches_one_process_from_the_seed_checkpoint_and_export_import_round_trips(tmp_path, capsys,
                                                                                         monkeypatch):
    # The features recipes on a smaller shape: the tool's seed checkpoint, launches and files are under test.
    here = str(Path(__file__).parent)
    monkeypatch.syspath_prepend(here)
    monkeypatch.setenv("PYTHONPATH", pythonpath_env(here)["PYTHONPATH"])
    base = "small_llama3:llama3_debugmodel"
    exported = tmp_path / "numbers.json"
    argv = ["--baseline", base, "--test", "small_llama3:llama3_fsdp2", "--test-ngpu", "2", "--steps", "2",
            "--rtol", "1e-5", "--out", str(tmp_path / "out"), "--export", str(exported)]
    assert loss_compare.main(argv) == 0, capsys.readouterr().err
    assert "within rtol 1e-05" in capsys.readouterr().out
    assert (tmp_path / "out" / "seed.safetensors").exists()
    numbers = json.loads(exported.read_text())
    assert numbers["test"]["ngpu"] == 2 and len(numbers["baseline"]["losses"]) == 2
    # The same single-process run again, against the imported baseline: bitwise equal.
    argv = ["--import", str(exported), "--test", base, "--steps", "2", "--assert-equal", "--out", str(tmp_path / "again")]
    assert loss_compare.main(argv) == 0, capsys.readouterr().err
    assert "loss_compare: equal" in capsys.readouterr().out
