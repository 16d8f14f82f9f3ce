"""Seed checkpoints and the loss-compare tool."""

import json
import re

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


@pytest.mark.parametrize("argv, message", [
    ([], r"give --baseline RECIPE"),
    (["--baseline", BASE, "--assert-equal", "--rtol", "1e-5"], r"--assert-equal \(exact\) and --rtol conflict"),
    (["--baseline", BASE, "--test-ngpu", "0"], r"--test-ngpu=0 must be >= 1"),
    (["--baseline", "nocolon"], r"recipe 'nocolon' must look like package.module:function"),
    (["--import", "/no/such.json", "--test", BASE], r"--import /no/such.json: no such file"),
    (["--baseline", BASE, "--seed-checkpoint", "/no/seed", "--no-seed-checkpoint"], r"conflict"),
    (["--baseline", BASE, "--baseline-commit", "no-such-ref-xyz", "--steps", "1"], r"cannot check out commit 'no-such-ref-xyz'"),
])
def test_bad_input_exits_2_with_one_line(argv, message, capsys):
    assert loss_compare.main(argv) == 2
    err = capsys.readouterr().err
    assert re.search(message, err) and len(err.strip().splitlines()) == 1, err


@pytest.mark.slow
@pytest.mark.multi_process
def test_fsdp2_matches_one_process_from_the_seed_checkpoint_and_export_import_round_trips(tmp_path, capsys):
    exported = tmp_path / "numbers.json"
    argv = ["--baseline", BASE, "--test", "recipes.tests.features:llama3_fsdp2", "--test-ngpu", "2", "--steps", "2",
            "--rtol", "1e-5", "--out", str(tmp_path / "out"), "--export", str(exported)]
    assert loss_compare.main(argv) == 0, capsys.readouterr().err
    assert "within rtol 1e-05" in capsys.readouterr().out
    assert (tmp_path / "out" / "seed.safetensors").exists()
    numbers = json.loads(exported.read_text())
    assert numbers["test"]["ngpu"] == 2 and len(numbers["baseline"]["losses"]) == 2
    # The same single-process run again, against the imported baseline: bitwise equal.
    argv = ["--import", str(exported), "--test", BASE, "--steps", "2", "--assert-equal", "--out", str(tmp_path / "again")]
    assert loss_compare.main(argv) == 0, capsys.readouterr().err
    assert "loss_compare: equal" in capsys.readouterr().out
