"""Golden numerics: export a run's per-step loss and grad norm, compare later runs exactly."""

import math
import re
from pathlib import Path
from types import SimpleNamespace

import lightning as L
import pytest
import torch

from recipes.tests import features
from titan_lightning.callbacks.golden import (GoldenNumerics, check_header, cpu_model, cpu_vendor, read_golden,
                                              write_golden)
from titan_lightning.parallel.mesh import ParallelDims
from titan_lightning.testing.record import RecordSteps
from titan_lightning.trainer import RUN_DIR_ENV, build_trainer


@pytest.fixture(autouse=True)
def run_folder(tmp_path, monkeypatch):
    monkeypatch.setenv(RUN_DIR_ENV, str(tmp_path / "run"))


def prepare(golden, run=None, max_steps=3):
    """A 3-step debug-model fit with ``golden``: (start it, what each step produced, the trainer)."""
    run = run or features.llama3_debugmodel()
    record = RecordSteps()  # before the golden callback: it holds a step's values when the comparison fails
    run.trainer.update(max_steps=max_steps, callbacks=[record, golden], accelerator="cpu", devices=1, logger=False)
    trainer = build_trainer(run)
    return (lambda: trainer.fit(run.module, datamodule=run.datamodule)), record, trainer


def fit(golden, run=None, max_steps=3):
    start, record, _ = prepare(golden, run, max_steps)
    start()
    return record


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    """One 3-step export shared by the module: (path, what RecordSteps saw)."""
    folder = tmp_path_factory.mktemp("golden")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv(RUN_DIR_ENV, str(folder / "run"))
        path = folder / "nested" / "llama3_debugmodel.txt"
        record = fit(GoldenNumerics(path, mode="export", config_name="llama3_debugmodel"))
    return path, record


def edited(exported, tmp_path, edit):
    path, _ = exported
    lines = path.read_text().splitlines()
    copy = tmp_path / "golden.txt"
    copy.write_text("\n".join(edit(lines)) + "\n")
    return copy


def test_export_writes_a_self_describing_file_whose_values_round_trip_exactly(exported):
    path, record = exported
    lines = path.read_text().splitlines()
    release = torch.__version__.split("+")[0]
    vendor, model = cpu_vendor(), cpu_model()
    cpu_lines = [f"# cpu: {vendor}"] + ([f"# cpu_model: {model}"] if model is not None else [])
    head = len(cpu_lines) + 6
    assert lines[:head] == [
        "# config: llama3_debugmodel", "# ngpu: 1", "# parallelism: single device", "# hardware: cpu",
        f"# torch: {release}", *cpu_lines, "# step loss grad_norm",
    ]
    rows = zip(record.steps, record.losses, record.grad_norms)
    assert lines[head:] == [f"{step} {loss!r} {norm!r}" for step, loss, norm in rows]
    golden = read_golden(path)
    assert golden.header == {"config": "llama3_debugmodel", "ngpu": "1", "parallelism": "single device",
                             "hardware": "cpu", "torch": release, "cpu": vendor,
                             **({"cpu_model": model} if model is not None else {})}
    assert golden.steps == [1, 2, 3]
    assert golden.losses == record.losses
    assert golden.grad_norms == record.grad_norms
    assert list(path.parent.iterdir()) == [path]  # parent created, no temporary file left


def test_the_header_names_the_module_class_by_default_and_the_strategy_layout():
    layout = ParallelDims(dp_replicate=1, dp_shard=2, cp=1, tp=2, pp=1, ep=1, world_size=4)
    module = features.llama3_debugmodel().module
    cpu = torch.device("cpu")
    trainer = SimpleNamespace(world_size=4, strategy=SimpleNamespace(dims=layout, root_device=cpu))
    assert GoldenNumerics("g.txt", mode="export").header(trainer, module) == {
        "config": "Llama3Module", "ngpu": "4", "parallelism": "FSDP=2, TP=2", "hardware": "cpu",
        "torch": torch.__version__.split("+")[0], "cpu": cpu_vendor(),
        **({"cpu_model": cpu_model()} if cpu_model() is not None else {}),
    }
    no_dims = SimpleNamespace(world_size=1, strategy=SimpleNamespace(root_device=cpu))
    assert GoldenNumerics("g.txt", config_name="x").header(no_dims, module)["parallelism"] == "single device"


def test_the_same_run_compares_equal(exported):
    path, record = exported
    assert fit(GoldenNumerics(path)).losses == record.losses


def test_a_slightly_different_learning_rate_fails_at_step_2(exported):
    # Step 1's loss and grad norm come from the initial weights, before any update, so they
    # match; the first update uses the changed lr, so step 2's loss is the first to differ.
    path, record = exported
    run = features.llama3_debugmodel()
    run.job.optimizer.lr *= 1.0001
    start, seen, trainer = prepare(GoldenNumerics(path), run)
    with pytest.raises(AssertionError, match=r"step 2 loss differs") as err:
        start()
    assert seen.losses[0] == record.losses[0] and seen.grad_norms[0] == record.grad_norms[0]
    message = str(err.value)
    assert str(path) in message
    assert f"expected {record.losses[1]!r}, got {seen.losses[1]!r}" in message
    assert trainer.global_step == 2  # stopped at once, not at the end


def test_an_edited_step_1_loss_fails_at_step_1_with_both_values(exported, tmp_path):
    true_loss = exported[1].losses[0]
    wrong = true_loss + 1e-6
    path = edited(exported, tmp_path, lambda lines: [
        f"1 {wrong!r} {line.split()[2]}" if line.startswith("1 ") else line for line in lines
    ])
    start, _, trainer = prepare(GoldenNumerics(path))
    with pytest.raises(AssertionError, match=re.escape(f"step 1 loss differs: expected {wrong!r}, got {true_loss!r}")):
        start()
    assert trainer.global_step == 1


def test_a_mismatch_names_the_torch_release_the_file_was_recorded_with(exported, tmp_path):
    def edit(lines):
        lines = [line.replace("# torch: ", "# torch: 0.0.") for line in lines]
        return [f"1 {float(line.split()[1]) + 1e-6!r} {line.split()[2]}" if line.startswith("1 ") else line
                for line in lines]

    start, _, _ = prepare(GoldenNumerics(edited(exported, tmp_path, edit)))
    with pytest.raises(AssertionError, match=r"\(the file was recorded with torch 0\.0\.[0-9.]+, this is "):
        start()


def test_a_golden_from_another_cpu_vendor_or_torch_is_not_comparable():
    from titan_lightning.callbacks.golden import Golden, comparable, torch_version

    here = {"torch": torch_version(), "cpu": cpu_vendor()}
    assert comparable(Golden(path=None, header=here), "cpu") is None
    other_cpu = {**here, "cpu": "SomeOtherVendor"}
    assert comparable(Golden(path=None, header=other_cpu), "cpu") == f"recorded on a SomeOtherVendor CPU, this is {cpu_vendor()}"
    assert comparable(Golden(path=None, header=other_cpu), "h200") is None  # the CPU vendor matters on CPU only
    old = {**here, "torch": "2.0.0"}
    assert comparable(Golden(path=None, header=old), "h200").startswith("recorded with torch 2.0.0")


def test_a_cpu_golden_that_names_its_model_compares_on_that_model_only(monkeypatch):
    from titan_lightning.callbacks import golden as golden_module
    from titan_lightning.callbacks.golden import Golden, comparable, torch_version

    info = {"vendor_id": "GenuineIntel", "cpu family": "6", "model": "207"}
    monkeypatch.setattr(golden_module, "_cpuinfo", lambda: info)
    header = {"torch": torch_version(), "cpu": "GenuineIntel"}
    assert comparable(Golden(path=None, header={**header, "cpu_model": "6/207"}), "cpu") is None
    assert comparable(Golden(path=None, header=header), "cpu") is None  # no model named: any model of the vendor
    assert comparable(Golden(path=None, header={**header, "cpu_model": "6/143"}), "cpu") == (
        "recorded on a GenuineIntel CPU of model 6/143, this is model 6/207")
    assert comparable(Golden(path=None, header={**header, "cpu_model": "6/143"}), "h200") is None


@pytest.mark.parametrize("info, folder", [
    ({"vendor_id": "AuthenticAMD", "cpu family": "25", "model": "1"}, "cpu_amd"),
    ({"vendor_id": "GenuineIntel", "cpu family": "6", "model": "207"}, "cpu_intel"),
    ({"vendor_id": "HygonGenuine"}, "cpu_hygongenuine"),
])
def test_cpu_goldens_live_in_their_vendor_s_folder_and_gpu_ones_in_their_class_s(monkeypatch, info, folder):
    from titan_lightning.callbacks import golden as golden_module
    from titan_lightning.callbacks.golden import hardware_folder
    from titan_lightning.testing.entries import TestEntry

    monkeypatch.setattr(golden_module, "_cpuinfo", lambda: info)
    assert hardware_folder("cpu") == folder and hardware_folder("h200") == "h200"
    entry = TestEntry(recipes=("recipes.tests.features:llama3_debugmodel",), name="e", description="d",
                      golden_numerics_path="{execution_mode}/{hardware}/e.txt")
    assert entry.golden_path("real_pg", Path("/g")) == Path(f"/g/real_pg/{folder}/e.txt")
    assert entry.golden_path("real_pg", Path("/g"), "h200") == Path("/g/real_pg/h200/e.txt")
    expected_model = f"{info['cpu family']}/{info['model']}" if "model" in info else None
    assert golden_module.cpu_model() == expected_model


def test_the_header_names_the_cpu_model_where_the_system_tells_it(monkeypatch):
    from titan_lightning.callbacks import golden as golden_module

    module = features.llama3_debugmodel().module
    trainer = SimpleNamespace(world_size=1, strategy=SimpleNamespace(root_device=torch.device("cpu")))
    monkeypatch.setattr(golden_module, "_cpuinfo", lambda: {"vendor_id": "GenuineIntel", "cpu family": "6", "model": "207"})
    header = GoldenNumerics("g.txt").header(trainer, module)
    assert (header["cpu"], header["cpu_model"]) == ("GenuineIntel", "6/207")
    monkeypatch.setattr(golden_module, "_cpuinfo", lambda: {})  # no /proc/cpuinfo (macOS): the machine type, no model
    header = GoldenNumerics("g.txt").header(trainer, module)
    assert "cpu_model" not in header and header["cpu"] == golden_module.cpu_vendor()


def _golden_text(loss: float) -> str:
    return ("# config: e\n# ngpu: 1\n# parallelism: single device\n# hardware: cpu\n# step loss grad_norm\n"
            f"1 {loss!r} 1.0\n")


@pytest.mark.parametrize("changed", [True, False])
def test_an_export_that_changes_an_entry_s_numbers_removes_the_other_vendors_stale_files(tmp_path, monkeypatch,
                                                                                          changed):
    from titan_lightning.callbacks.golden import hardware_folder
    from titan_lightning.testing import integration
    from titan_lightning.testing.entries import TestEntry

    entry = TestEntry(recipes=("recipes.tests.features:llama3_debugmodel",), name="e", description="d",
                      golden_numerics_path="{execution_mode}/{hardware}/e.txt")
    root = tmp_path / "losses"
    mine, other = root / "fake_pg" / hardware_folder("cpu") / "e.txt", root / "fake_pg" / "cpu_othervendor" / "e.txt"
    for path in (mine, other):
        path.parent.mkdir(parents=True)
        path.write_text(_golden_text(2.0))
    assert entry.other_cpu_goldens("fake_pg", root) == [other]

    def run(argv, out_dir, golden_options):  # the export a run writes, without training
        target = Path(golden_options[golden_options.index("--golden") + 1])
        target.write_text(_golden_text(3.0 if changed else 2.0).replace("# config: e", "# config: again"))
        return {"rank": 0}

    monkeypatch.setattr(integration, "_run_in_process", run)
    result = integration.run_entry(entry, "fake_pg", tmp_path / "out", export=True, golden_root=root, in_process=True)
    assert result.golden == mine and result.golden_status == "exported"
    assert other.exists() is not changed  # the same numbers (only the header differs) keep the other vendor's file


def test_a_legacy_step_loss_file_compares_losses_only(exported, tmp_path):
    _, record = exported
    path = tmp_path / "legacy.txt"
    path.write_text("".join(f"{s} {loss!r}\n" for s, loss in zip(record.steps, record.losses)))
    assert read_golden(path).grad_norms is None
    fit(GoldenNumerics(path))

    path.write_text(f"1 {record.losses[0] * 2!r}\n")
    with pytest.raises(AssertionError, match=r"step 1 loss differs"):
        fit(GoldenNumerics(path))


def test_fewer_steps_than_the_file_fail_at_train_end(exported, tmp_path):
    path = edited(exported, tmp_path, lambda lines: lines + ["4 1.0 1.0"])
    start, _, trainer = prepare(GoldenNumerics(path))
    with pytest.raises(AssertionError, match=r"fewer steps ran \(3\) than the file has \(4\)"):
        start()
    assert trainer.global_step == 3


def test_more_steps_than_the_file_fail_at_train_end(exported, tmp_path):
    path = edited(exported, tmp_path, lambda lines: lines[:-1])
    with pytest.raises(AssertionError, match=r"more steps ran \(3\) than the file has \(2\)"):
        fit(GoldenNumerics(path))


def test_a_missing_golden_file_fails_at_setup_naming_the_path_and_how_to_make_it(tmp_path):
    path = tmp_path / "absent.txt"
    start, _, trainer = prepare(GoldenNumerics(path))
    with pytest.raises(FileNotFoundError, match=re.escape(f"{path} does not exist")) as err:
        start()
    assert 'mode="export"' in str(err.value)
    assert trainer.global_step == 0


def test_a_module_without_a_grad_norm_is_refused_at_setup_by_name(tmp_path):
    class NoNorm(L.LightningModule):
        pass

    with pytest.raises(AttributeError, match=r"NoNorm has no `last_grad_norm` attribute"):
        GoldenNumerics(tmp_path / "g.txt", mode="export").setup(None, NoNorm(), "fit")


def test_check_header_refuses_another_world_size_or_layout(exported):
    golden = read_golden(exported[0])
    check_header(golden, ngpu=1, parallelism="single device")
    with pytest.raises(ValueError, match=r"'# ngpu: 1' but this run has ngpu '8'"):
        check_header(golden, ngpu=8, parallelism="single device")
    with pytest.raises(ValueError, match=r"'# parallelism: single device' but this run has parallelism 'FSDP=2, TP=2'"):
        check_header(golden, ngpu=1, parallelism="FSDP=2, TP=2")
    check_header(golden, ngpu=1, parallelism="single device", hardware="cpu")
    with pytest.raises(ValueError, match=r"'# hardware: cpu' but this run has hardware 'h200'"):
        check_header(golden, ngpu=1, parallelism="single device", hardware="h200")


def test_compare_refuses_at_setup_a_file_of_another_layout(exported, tmp_path):
    path = edited(exported, tmp_path, lambda lines: [line.replace("# ngpu: 1", "# ngpu: 4") for line in lines])
    start, record, _ = prepare(GoldenNumerics(path))
    with pytest.raises(ValueError, match=r"'# ngpu: 4' but this run has ngpu '1'"):
        start()
    assert record.steps == []  # refused before the first step


def test_a_malformed_line_names_the_file_and_line(tmp_path):
    path = tmp_path / "bad.txt"
    path.write_text("# config: x\n# ngpu: 1\n# parallelism: single device\n# step loss grad_norm\n\n1 7.5 3.0\n2 7.4\n")
    with pytest.raises(ValueError, match=re.escape(f"{path}:7: expected 3 fields")):
        read_golden(path)
    path.write_text("1 7.5\ntwo 7.4\n")
    with pytest.raises(ValueError, match=re.escape(f"{path}:2: expected an integer step")):
        read_golden(path)


def test_non_finite_values_are_never_written_or_accepted(tmp_path):
    path = tmp_path / "g.txt"
    with pytest.raises(ValueError, match=r"step 2 has non-finite grad_norm inf"):
        write_golden(path, {"config": "x"}, [(1, 7.5, 3.0), (2, 7.4, math.inf)])
    assert not path.exists() and not list(tmp_path.iterdir())
    path.write_text("1 7.5\n2 nan\n")
    with pytest.raises(ValueError, match=re.escape(f"{path}:2: non-finite loss nan")):
        read_golden(path)
