"""Hugging Face model folders: config.json in, complete folders out.

A folder is a run through ``recipes.hf:pretrained``:

    titan-lightning fit --recipe recipes.hf:pretrained --job.checkpoint.initial_load_path DIR

``DIR`` is what ``save_pretrained`` writes (config.json, safetensors, tokenizer files). The
family and its args come from config.json (``model_type``: see ``hf_families``), each field
mapped, checked or refused by name (models/common/hf_config.py); the tokenizer is the folder's;
tied embeddings load as an untied copy. A recipe that names a preset and loads a folder
(``checkpoint.initial_load_format=hf``) is checked against its config.json before launch
(``check_folder_matches``).

An ``export_format=hf`` export (callbacks/weights.py) is a folder ``from_pretrained`` loads as it
is: config.json (``hf_config`` of the family, the export dtype, untied embeddings: training
unties them), generation_config.json, the tokenizer files, the safetensors.
"""

from __future__ import annotations

import json
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Optional

import torch

from titan_lightning.config import ConfigError
from titan_lightning.data.tokenizer import load_tokenizer, tokenizer_file
from titan_lightning.lora import base_only
from titan_lightning.models.common.hf_config import CONFIG_FILE, HFConfig, read_config_json
from titan_lightning.models.deepseek_v3 import DeepSeekV3Job, DeepSeekV3Module
from titan_lightning.models.gemma3 import Gemma3Job, Gemma3Module
from titan_lightning.models.gpt_oss import GptOssJob, GptOssModule
from titan_lightning.models.llama3 import Llama3Job, Llama3Module
from titan_lightning.models.mistral import MistralJob, MistralModule
from titan_lightning.models.olmo2 import Olmo2Job, Olmo2Module
from titan_lightning.models.phi3 import Phi3Job, Phi3Module
from titan_lightning.models.qwen2 import Qwen2Job, Qwen2Module
from titan_lightning.models.qwen3 import Qwen3Job, Qwen3Module

if TYPE_CHECKING:  # a Run's type only
    from titan_lightning.run import Run

# Tokenizer files copied into an export next to the weights, when the tokenizer's folder has them.
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja")
GENERATION_FILE = "generation_config.json"


def hf_families() -> dict[str, tuple[type, type]]:
    """config.json ``model_type`` -> (the family's JobConfig, its LightningModule)."""
    families = {}
    for job_class, module_class in ((Llama3Job, Llama3Module), (Qwen3Job, Qwen3Module),
                                    (DeepSeekV3Job, DeepSeekV3Module), (Qwen2Job, Qwen2Module),
                                    (MistralJob, MistralModule), (GptOssJob, GptOssModule),
                                    (Gemma3Job, Gemma3Module), (Phi3Job, Phi3Module), (Olmo2Job, Olmo2Module)):
        families.update(dict.fromkeys(module_class.hf_adapter.hf_model_types, (job_class, module_class)))
    return families


@dataclass
class HFModel:
    """What a Hugging Face folder's config.json says: the family, its args, tied embeddings."""

    folder: Path
    job_class: type
    module_class: type
    args: Any
    tie_word_embeddings: bool


def read_hf_model(folder: Any) -> HFModel:
    """The family and args of the model in ``folder``; one-line ConfigError naming the field otherwise."""
    folder = Path(folder)
    config = read_config_json(folder)
    source = str(folder / CONFIG_FILE)
    families = hf_families()
    model_type = config.get("model_type")
    if model_type not in families:
        raise ConfigError(f"{source}: model_type={json.dumps(model_type)} is not supported; supported: "
                          f"{', '.join(families)}")
    job_class, module_class = families[model_type]
    reader = HFConfig(config, source, module_class.hf_adapter.family)
    try:
        args = module_class.hf_adapter.args_from_hf_config(reader)
    except (TypeError, ValueError) as err:
        if isinstance(err, ConfigError):
            raise
        raise ConfigError(f"{source}: {' '.join(str(err).split())}") from None
    reader.finish()
    tied = config.get("tie_word_embeddings", module_class.hf_adapter.ties_by_default)
    return HFModel(folder, job_class, module_class, args, bool(tied))


def check_folder_matches(args: Any, adapter_class: type, folder: Any) -> None:
    """``args`` describe the model of ``folder``'s config.json: one line naming the first field
    that differs, with both values."""
    theirs = read_hf_model(folder)
    if not issubclass(adapter_class, theirs.module_class.hf_adapter) and \
            not issubclass(theirs.module_class.hf_adapter, adapter_class):
        raise ConfigError(f"{Path(folder) / CONFIG_FILE} holds a {theirs.module_class.hf_adapter.family} model; "
                          f"this run builds {adapter_class.family}")
    ours, expected = adapter_class.hf_config(args), adapter_class.hf_config(theirs.args)
    for key in sorted(set(ours) | set(expected)):
        if ours.get(key) != expected.get(key):
            raise ConfigError(f"model args differ from {Path(folder) / CONFIG_FILE}: {key} is "
                              f"{json.dumps(ours.get(key))} here, {json.dumps(expected.get(key))} there")


def check_initial_hf_weights(command: str, run: Run) -> None:
    """Before launch: the safetensors a fresh ``fit`` will load (``checkpoint.initial_load_path``,
    ``initial_load_format=hf``) hold every tensor of the run's model in its shape, and no file is
    shorter than its header says. Only the headers are read; the model is built on the meta device.
    One-line ConfigError naming the tensor and both shapes, or the file and both sizes."""
    job, module = run.job, run.module
    if command != "fit" or job is None or run.ckpt_path is not None:
        return
    folder = job.checkpoint.initial_load_path
    if folder is None or job.checkpoint.initial_load_format != "hf":
        return
    adapter = module.state_dict_adapter() if hasattr(module, "state_dict_adapter") else None
    if adapter is None or not hasattr(module, "build_model"):
        return  # a module of its own kind: its loader checks what it loads
    if (Path(folder) / CONFIG_FILE).is_file() and \
            read_config_json(Path(folder)).get("tie_word_embeddings", type(adapter).ties_by_default):
        adapter = type(adapter)(adapter.args, tie_word_embeddings=True)
    with torch.device("meta"):
        model = module.build_model()
    try:
        with base_only(model) as base:  # (a LoRA run's adapters start where the folder stops)
            adapter.check_folder(base, folder)
    except (OSError, ValueError) as err:
        if isinstance(err, ConfigError):
            raise
        raise ConfigError(f"checkpoint.initial_load_path={folder!r}: {' '.join(str(err).split())}") from None
    check_folder_tokenizer(job)


def check_folder_tokenizer(job: Any) -> None:
    """A Hugging Face folder without tokenizer.json, and no ``data.tokenizer_path``: the run would
    tokenize with the shipped 2048-token test tokenizer and export it as the model's. Refused, in
    one line saying what to pass."""
    folder = Path(job.checkpoint.initial_load_path)
    if job.data.tokenizer_path is None and (folder / CONFIG_FILE).is_file() and not (folder / "tokenizer.json").is_file():
        raise ConfigError(f"checkpoint.initial_load_path={str(folder)!r} has no tokenizer.json, and data.tokenizer_path "
                          f"is not set: the run would use the shipped 2048-token test tokenizer and export it as the "
                          f"model's; pass the model's tokenizer folder: --job.data.tokenizer_path DIR")


def tokenizer_folder(tokenizer_path: Optional[str]) -> Path:
    """The folder whose tokenizer files an export copies (the shipped tokenizer's for None)."""
    return tokenizer_file(tokenizer_path).parent


def write_hf_metadata(folder: Path, adapter: Any, dtype: str, tokenizer_path: Optional[str],
                      model_folder: Optional[str] = None) -> None:
    """config.json, generation_config.json and the tokenizer files of an export in ``folder``.
    ``model_folder``: the Hugging Face folder the run started from; its generation_config.json's
    settings (sampling, temperature, top_p, its list of end-of-turn ids...) carry over."""
    tokenizer = load_tokenizer(tokenizer_path)
    ids = {"bos_token_id": tokenizer.bos_id, "eos_token_id": tokenizer.eot_id}
    config = {**adapter.hf_config(adapter.args), **ids, "torch_dtype": dtype, "tie_word_embeddings": False}
    (folder / CONFIG_FILE).write_text(json.dumps(config, indent=2) + "\n")
    generation = {k: v for k, v in ids.items() if v is not None}
    if model_folder is not None and (Path(model_folder) / GENERATION_FILE).is_file():
        try:
            theirs = json.loads((Path(model_folder) / GENERATION_FILE).read_text())
        except (OSError, ValueError):
            theirs = None  # unreadable: the export writes its own, as for a folder without one
        if isinstance(theirs, dict):
            generation = {**generation, **{k: v for k, v in theirs.items() if k != "transformers_version"}}
    (folder / GENERATION_FILE).write_text(json.dumps(generation, indent=2) + "\n")
    source = tokenizer_folder(tokenizer_path)
    for name in TOKENIZER_FILES:
        if (source / name).is_file():
            shutil.copyfile(source / name, folder / name)
    if not (folder / "tokenizer_config.json").is_file():
        tokens = {"eos_token": tokenizer.eot_token, **({"bos_token": tokenizer.bos_token} if tokenizer.bos_token else {})}
        settings = {"tokenizer_class": "PreTrainedTokenizerFast", "model_max_length": config.get("max_position_embeddings"),
                    **tokens}
        (folder / "tokenizer_config.json").write_text(json.dumps(settings, indent=2) + "\n")
