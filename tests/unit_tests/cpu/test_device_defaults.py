"""The speed settings a run's device chooses (titan_lightning/device_defaults.py): on a GPU bf16
mixed precision, compiled blocks, the fastest exact attention kernel and the window, microbatch and
activation checkpointing that fit by the memory estimator; on CPU nothing. Explicit fields are
kept (command line, --config, the user's recipe code, a --print_config file's record), and the
combinations a GPU cannot run are refused before launch in one line."""

import importlib.util
import re
from dataclasses import replace

import pytest
import torch

import recipes.gpt_oss
import recipes.hf
import recipes.llama3
from titan_lightning import cli, device_defaults
from titan_lightning.config import ConfigError
from titan_lightning.config.validation import validate_attention_kernel, validate_gpu
from titan_lightning.device_defaults import GiB, Device, choose, explicit_fields
from titan_lightning.strategies import TitanStrategy
from titan_lightning.trainer import RUN_DIR_ENV, build_trainer

from tests.hf_folders import save_hf_folder

H200 = Device(type="cuda", name="NVIDIA H200", memory=141 * GiB, bf16=True, compiles=True, varlen=True,
              varlen_window=True)
CARD_24 = replace(H200, name="a 24 GiB card", memory=24 * GiB)
CARD_16 = replace(H200, name="a 16 GiB card", memory=16 * GiB)
NO_BF16 = replace(H200, name="a card without bf16", memory=16 * GiB, bf16=False)


def fake_peak(job) -> int:
    """10 GiB of weights and states, 1 GiB of activations per 1024 tokens (a quarter of it under
    full activation checkpointing)."""
    t = job.training
    per_token = 0.25 if job.activation_checkpoint.mode == "full" else 1.0
    return int(GiB * (10 + t.tokens_per_microbatch_per_dp_rank / 1024 * per_token))


def fits(job, device) -> bool:
    return fake_peak(job) <= device_defaults.MEMORY_FRACTION * device.memory


def sft_job(**training):
    """As recipes.hf:sft sets a model of 8192 positions: block_causal, one 2048-token window, fp32."""
    job = recipes.llama3.debugmodel().job
    return replace(job, model=replace(job.model, mask="block_causal", positions="per_document", max_seq_len=8192),
                   training=replace(job.training, seq_len=2048, tokens_per_microbatch_per_dp_rank=2048, **training))


def test_an_h200_gets_bf16_compiled_varlen_and_a_full_microbatch():
    choice = choose(sft_job(), H200, peak=fake_peak)
    job = choice.job
    assert (job.training.dtype, job.training.mixed_precision_param) == ("float32", "bfloat16")  # bf16-mixed
    assert job.compile.enable and job.model.attention == "varlen"
    assert job.training.seq_len == device_defaults.SEQ_LEN
    assert job.training.tokens_per_microbatch_per_dp_rank == device_defaults.TOKENS_PER_MICROBATCH
    assert job.activation_checkpoint.mode == "none" and fits(job, H200)
    assert choice.line.startswith("titan-lightning: on NVIDIA H200 (141 GiB): bf16-mixed, compiled blocks, varlen "
                                  "attention (block_causal), seq_len 4096 x 4 per microbatch, no activation "
                                  "checkpointing (estimated peak ")
    assert "the recipe's 1 x 2048 = 2048" in choice.line  # the global batch changed: said


def test_smaller_cards_get_the_largest_microbatch_that_fits_then_checkpointing():
    job = choose(sft_job(), CARD_24, peak=fake_peak).job
    doubled = replace(job, training=replace(job.training, tokens_per_microbatch_per_dp_rank=2 * job.training
                                            .tokens_per_microbatch_per_dp_rank))
    assert job.activation_checkpoint.mode == "none" and fits(job, CARD_24) and not fits(doubled, CARD_24)
    assert job.training.tokens_per_microbatch_per_dp_rank < device_defaults.TOKENS_PER_MICROBATCH
    one = replace(job, training=replace(job.training, tokens_per_microbatch_per_dp_rank=job.training.seq_len))
    assert not fits(one, CARD_16)  # one window without checkpointing does not fit 16 GiB ...
    job = choose(sft_job(), CARD_16, peak=fake_peak).job
    assert job.activation_checkpoint.mode == "full" and fits(job, CARD_16)  # ... with full checkpointing it does


def test_a_card_without_bf16_stays_fp32_and_masks_with_flex():
    choice = choose(sft_job(), NO_BF16, peak=fake_peak)
    assert choice.job.training.mixed_precision_param == "float32"  # (varlen's FlashAttention is bf16 only)
    assert choice.job.model.attention == "flex" and choice.job.compile.enable
    assert "fp32 (no bf16 on this GPU)" in choice.line
    bf16 = sft_job(dtype="bfloat16", mixed_precision_param="bfloat16")  # a recipe's bf16 becomes fp32 there ...
    assert choose(bf16, NO_BF16).job.training.dtype == "float32"
    kept = choose(bf16, NO_BF16, explicit=device_defaults.PRECISION).job  # ... unless given (then refused)
    assert kept.training.dtype == "bfloat16"


def test_cpu_changes_nothing():
    job = sft_job()
    assert choose(job, Device(type="cpu"), peak=fake_peak) == device_defaults.Choice(job, None)


def test_the_kernel_is_exact_for_the_mask():
    causal = recipes.llama3.debugmodel().job
    assert choose(causal, H200).job.model.attention == "sdpa"  # flash / cuDNN through is_causal
    sinks = recipes.gpt_oss.debugmodel().job  # sliding windows, and sinks varlen cannot compute
    assert choose(sinks, H200).job.model.attention == "flex"
    assert choose(sft_job(), replace(H200, varlen=False)).job.model.attention == "flex"
    assert choose(sft_job(), replace(H200, varlen=False, compiles=False)).job.model.attention == "sdpa"


def test_explicit_fields_are_kept():
    explicit = {"training.seq_len", "model.attention", "compile.enable", *device_defaults.PRECISION}
    choice = choose(sft_job(), H200, explicit=explicit, peak=fake_peak)
    job = choice.job
    assert (job.training.seq_len, job.model.attention, job.compile.enable) == (2048, "sdpa", False)
    assert job.training.mixed_precision_param == "float32"
    assert job.training.tokens_per_microbatch_per_dp_rank % 2048 == 0 and job.training.microbatch_size > 1
    assert choice.line.endswith("explicit: compile.enable, model.attention, training.dtype, "
                                "training.mixed_precision_param, training.seq_len")
    kept = choose(sft_job(), H200, explicit={"training.tokens_per_microbatch_per_dp_rank"}, peak=fake_peak).job
    assert kept.training.tokens_per_microbatch_per_dp_rank == 2048 and kept.training.seq_len == 2048


def test_sizes_all_given_are_not_estimated():
    def never(job):
        raise AssertionError("estimated")

    choice = choose(sft_job(), H200, explicit=device_defaults.SIZES, peak=never)
    assert choice.job.training == replace(sft_job().training, mixed_precision_param="bfloat16")
    assert "sizes as given" in choice.line


def test_the_recipes_tokens_per_step_is_kept():
    job = choose(sft_job(tokens_per_step=8192), H200, peak=fake_peak).job
    assert job.training.tokens_per_step == 8192
    assert 8192 % job.training.tokens_per_microbatch_per_dp_rank == 0


def test_a_model_that_does_not_fit_keeps_the_recipes_sizes_and_says_so():
    tiny = replace(H200, name="a tiny card", memory=8 * GiB)
    choice = choose(sft_job(), tiny, peak=fake_peak)
    assert choice.job.training == replace(sft_job().training, mixed_precision_param="bfloat16")
    assert "do not fit one device" in choice.line and "add GPUs" in choice.line


def test_what_the_estimator_cannot_model_keeps_the_sizes_and_says_why():
    def cannot(job):
        raise ValueError("estimate cannot model Transformer: an op reads tensor values")

    choice = choose(sft_job(), H200, peak=cannot)
    assert choice.job.training == replace(sft_job().training, mixed_precision_param="bfloat16")
    assert "sizes as the recipe set them (the estimator: estimate cannot model Transformer" in choice.line


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    """A Qwen 2 folder of 8192 positions, with its tokenizer."""
    path = tmp_path_factory.mktemp("hf") / "qwen2"
    save_hf_folder(path, "qwen2", max_position_embeddings=8192)
    return path


def sft_argv(folder, *more):
    return ["--recipe", "recipes.hf:sft", "--job.checkpoint.initial_load_path", str(folder),
            "--job.data.dataset_path", "data/sft", *more]


@pytest.mark.parametrize("recipe,reference", [("sft", None), ("lora", None), ("qlora", None), ("dpo", "precomputed"),
                                              ("dpo", "frozen"), ("dpo_lora", None)])
def test_the_estimator_sizes_a_real_model(folder, recipe, reference):
    """Every fine-tuning recipe's run is sized by the estimator on a GPU, DPO with each reference (a
    LoRA base or a frozen reference stored in bf16 once failed it, and the run kept the recipe's sizes)."""
    run = getattr(recipes.hf, recipe)(str(folder), "data/sft")
    if reference is not None:
        run.job.preference.reference = reference
    assert recipe != "dpo_lora" or run.job.preference.reference == "adapters_off"
    # (eager sdpa: the estimate of compiled blocks traces them, seconds a call; test_estimate covers the kernels)
    choice = choose(run.job, H200, explicit={"compile.enable", "model.attention"}, peak=device_defaults._estimator(run, 1))
    assert choice.job.training.tokens_per_microbatch_per_dp_rank == device_defaults.TOKENS_PER_MICROBATCH, choice.line
    assert re.search(r"estimated peak [01] GiB of 141", choice.line)  # a model of 64 dimensions (and its reference)


def test_the_command_line_names_explicit_fields_and_print_config_keeps_them(folder, tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    run = cli.parse_run(sft_argv(folder, "--job.training.seq_len", "2048", "--trainer.precision=32-true"))
    assert {"training.seq_len", *device_defaults.PRECISION} <= explicit_fields(run)
    assert "compile.enable" not in explicit_fields(run)
    assert cli.parse_run(sft_argv(folder, "--job.training.seq_len", "2048", "--print_config")) is None
    saved = capsys.readouterr().out
    assert saved.rstrip().endswith("\n# explicit: job.training.seq_len")
    assert cli.parse_run(sft_argv(folder, "--print_config")) is None
    assert "# explicit" not in capsys.readouterr().out  # (the recipe's folder and data choose nothing)
    (tmp_path / "run.yaml").write_text(saved.replace("enable: false", "enable: true", 1))
    again = cli.parse_run(["--config", "run.yaml"])
    assert {"training.seq_len", "compile.enable"} <= explicit_fields(again)  # listed; changed in the file
    assert not {"model.attention", "training.tokens_per_microbatch_per_dp_rank"} & explicit_fields(again)


def test_the_users_own_recipe_code_is_explicit(folder):
    run = recipes.hf.sft(str(folder), "data/sft")
    assert explicit_fields(run) == set()
    run.job.model.attention = "flex"  # (a recipe of one's own, after the shipped one)
    assert explicit_fields(run) == {"model.attention"}


def test_on_cpu_the_sft_recipe_trains_as_the_recipe_set_it(folder, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv(RUN_DIR_ENV, raising=False)
    run = cli.parse_run(sft_argv(folder))
    build_trainer(run)
    assert run.job == run.device_choice.recipe and run.job.training.mixed_precision_param == "float32"


def fake_gpu(monkeypatch, device: Device) -> None:
    """build_trainer on ``device``: the strategy's root device, its description, its capability."""
    monkeypatch.setattr(TitanStrategy, "root_device", property(lambda self: torch.device("cuda", 0)))
    monkeypatch.setattr(Device, "of", classmethod(lambda cls, where, world_size: device))
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *a: (9, 0) if device.bf16 else (7, 5))


def test_the_choice_is_applied_and_said_once_on_a_gpu(folder, tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv(RUN_DIR_ENV, raising=False)
    fake_gpu(monkeypatch, replace(H200, compiles=False))  # (no triton here: compile would be refused)
    monkeypatch.setattr(device_defaults, "_estimator", lambda run, world_size: fake_peak)
    run = cli.parse_run(sft_argv(folder, "--job.training.seq_len", "2048"))
    build_trainer(run)
    lines = [line for line in capsys.readouterr().out.splitlines() if line.startswith("titan-lightning: on ")]
    assert len(lines) == 1 and "varlen attention (block_causal), seq_len 2048 x 8" in lines[0], lines
    assert lines[0].endswith("explicit: training.seq_len")
    assert run.job.model.attention == "varlen" and run.job.training.seq_len == 2048


@pytest.mark.parametrize("flags, message", [
    (["--job.model.attention", "varlen", "--trainer.precision", "32-true"],
     "model.attention='varlen' runs FlashAttention in bf16 only"),
    (["--job.compile.enable", "true"], "compile.enable=True with compile.backend='inductor' makes Triton kernels"),
])
def test_what_a_gpu_cannot_run_is_refused_before_launch(folder, tmp_path, monkeypatch, capfd, flags, message):
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv(RUN_DIR_ENV, raising=False)
    fake_gpu(monkeypatch, replace(H200, compiles=False))
    find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "triton" else find_spec(name, *a))
    assert cli.main(["fit", *sft_argv(folder, *flags)]) == 2
    err = capfd.readouterr().err
    assert err.count("\n") == 1 and message in err and "Traceback" not in err, err


def test_gpu_rules():
    job = sft_job()
    bf16 = replace(job, training=replace(job.training, mixed_precision_param="bfloat16"))
    with pytest.raises(ConfigError, match="training.mixed_precision_param='bfloat16' needs a GPU with bf16 "
                                          r"\(compute capability 8.0 or newer\), this one is 7.5"):
        validate_gpu(bf16, "cuda", (7, 5), True)
    validate_gpu(bf16, "cuda", (8, 0), True)
    compiled = replace(job, compile=replace(job.compile, enable=True))
    with pytest.raises(ConfigError, match="triton is not installed: set --job.compile.enable false"):
        validate_gpu(compiled, "cuda", (9, 0), False)
    validate_gpu(compiled, "cpu")  # (CPU compiles C++)
    varlen = replace(job, model=replace(job.model, attention="varlen"))
    with pytest.raises(ConfigError, match="runs FlashAttention on CUDA only"):
        validate_attention_kernel(varlen, "cpu")
    with pytest.raises(ConfigError, match="bf16 only"):
        validate_attention_kernel(varlen, "cuda")
    validate_attention_kernel(replace(varlen, training=bf16.training), "cuda")
