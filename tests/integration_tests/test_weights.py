"""Model weights in and out of runs on real process groups (gloo): a Hugging Face export from
two pipeline stages, loaded by FSDP2 x TP2 and exported sharded, loaded back by the pipeline
and exported to Hugging Face again, gives the same tensors bit for bit. The later runs train
with a learning rate of 1e-30, which leaves fp32 weights unchanged."""

import pytest
import torch
from safetensors.torch import load_file

from titan_lightning.testing.launch import launch
from titan_lightning.trainer import RUN_DIR_ENV

pytestmark = pytest.mark.multi_process


# The debug model's 6 layers (3 per pipeline stage) at a smaller width: the layouts are under test.
SHAPE = {"dim": 64, "n_heads": 4, "n_kv_heads": 4}


def fit(recipe: str, world: int, run_dir, *overrides: str) -> dict:
    shape = [arg for name, value in SHAPE.items() for arg in (f"--job.model.{name}", str(value))]
    argv = ["fit", "--recipe", f"recipes.tests.features:{recipe}", "--trainer.accelerator", "cpu",
            "--trainer.devices", str(world), "--trainer.max_steps", "2", *shape, *overrides]
    return launch(argv, world, out_dir=run_dir.with_name(run_dir.name + "_logs"), timeout=300,
                  env={RUN_DIR_ENV: str(run_dir)}).ranks[0]


def _hf(folder) -> dict[str, torch.Tensor]:
    tensors = {}
    for file in sorted(folder.glob("*.safetensors")):
        tensors.update(load_file(str(file)))
    return tensors


@pytest.mark.slow
def test_weights_round_trip_through_hugging_face_and_sharded_exports_on_three_layouts(tmp_path):
    frozen = ("--job.optimizer.lr", "1e-30")
    fit("llama3_pp2", 2, tmp_path / "a", "--job.checkpoint.export_format", "hf")
    fit("llama3_fsdp2_tp2", 4, tmp_path / "b", *frozen, "--job.checkpoint.initial_load_path", str(tmp_path / "a/export_hf"),
        "--job.checkpoint.initial_load_format", "hf", "--job.checkpoint.export_format", "dcp")
    assert (tmp_path / "b/export/.metadata").is_file()
    fit("llama3_pp2", 2, tmp_path / "c", *frozen, "--job.checkpoint.initial_load_path", str(tmp_path / "b/export"),
        "--job.checkpoint.export_format", "hf")
    first, last = _hf(tmp_path / "a/export_hf"), _hf(tmp_path / "c/export_hf")
    assert "lm_head.weight" in first and "model.layers.5.mlp.down_proj.weight" in first  # both stages' halves
    assert first.keys() == last.keys()
    assert all(torch.equal(first[k], last[k]) for k in first)
    # The trained weights moved away from the init (the export is not of an untrained model).
    from recipes.tests import features
    from titan_lightning.models.llama3 import Transformer

    run = features.llama3_debugmodel()
    for name, value in SHAPE.items():
        setattr(run.job.model, name, value)
    init = Transformer(run.job.model)
    init.init_weights(seed=0)
    hf_init = run.module.state_dict_adapter().to_hf(init.state_dict())
    assert not torch.equal(hf_init["model.layers.0.self_attn.q_proj.weight"], first["model.layers.0.self_attn.q_proj.weight"])
