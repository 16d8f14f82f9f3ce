"""Hugging Face model folders: config.json in, complete folders out.

A folder is a run through ``recipes.hf:pretrained``:

    titan-lightning fit --recipe recipes.hf:pretrained --job.checkpoint.initial_load_path DIR

``DIR`` is what ``save_pretrained`` writes (config.json, safetensors, tokenizer files). The
family and its args come from config.json (``model_type``: models/registry.py lists the families),
each field mapped, checked or refused by name (models/common/hf_config.py); the tokenizer is the
folder's; tied embeddings load as an untied copy.

A folder is read once per launch (``read_hf_model``): what its config.json says (``HFModel``)
stays on the run's module (``folder_model``) for the one pre-launch check of the folder
(``check_hf_folder``: family and args, every tensor's shape, the tokenizer), which a recipe that
names a preset and loads a folder (``checkpoint.initial_load_format=hf``) passes too, and for the
load (``folder_adapter``).

An ``export_format=hf`` export (callbacks/weights.py) is a folder ``from_pretrained`` loads as it
is: config.json (``hf_config`` of the family, the export dtype, untied embeddings: training
unties them), generation_config.json, the tokenizer files, the safetensors.
"""

import json
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

import torch

from titan_lightning.config import ConfigError
from titan_lightning.data.tokenizer import load_tokenizer, tokenizer_file
from titan_lightning.lora import base_only
from titan_lightning.models.common.hf_config import CONFIG_FILE, HFConfig, read_config_json
from titan_lightning.models.registry import hf_families

# Tokenizer files copied into an export next to the weights, when the tokenizer's folder has them.
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja")
GENERATION_FILE = "generation_config.json"


@dataclass
class HFModel:
    """What a Hugging Face folder's config.json says: the family, its args, tied embeddings."""

    folder: Path
    job_class: type
    module_class: type
    args: Any
    tie_word_embeddings: bool

    def adapter(self, args: Any = None) -> Any:
        """The family's state-dict adapter for ``args`` (the folder's by default), tied as the folder is."""
        return self.module_class.hf_adapter(self.args if args is None else args,
                                            tie_word_embeddings=self.tie_word_embeddings)

    def check_matches(self, args: Any, adapter_class: type) -> None:
        """``args`` (of ``adapter_class``'s family) describe this model: one line naming the first
        config.json field that differs, with both values."""
        source, theirs = self.folder / CONFIG_FILE, self.module_class.hf_adapter
        if not issubclass(adapter_class, theirs) and not issubclass(theirs, adapter_class):
            raise ConfigError(f"{source} holds a {theirs.family} model; this run builds {adapter_class.family}")
        ours, expected = adapter_class.hf_config(args), adapter_class.hf_config(self.args)
        for key in sorted(set(ours) | set(expected)):
            if ours.get(key) != expected.get(key):
                raise ConfigError(f"model args differ from {source}: {key} is {json.dumps(ours.get(key))} here, "
                                  f"{json.dumps(expected.get(key))} there")


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
    """``args`` describe the model of ``folder``'s config.json (``HFModel.check_matches``)."""
    read_hf_model(folder).check_matches(args, adapter_class)


def folder_model(module: Any, folder: Any) -> HFModel:
    """The ``HFModel`` of ``folder`` as the run holds it: read once per launch (by the recipe, or
    here by the pre-launch check) and kept on the module (``hf_model``) for the check and the load."""
    kept = getattr(module, "hf_model", None)
    if kept is None or kept.folder != Path(folder):
        kept = read_hf_model(folder)
        module.hf_model = kept
    return kept


def folder_adapter(module: Any, folder: Any) -> Any:
    """``module``'s state-dict adapter for loading ``folder``, tied as its config.json says (a
    folder without one: untied); None for a module without an adapter."""
    adapter = module.state_dict_adapter() if hasattr(module, "state_dict_adapter") else None
    tied = adapter is not None and (Path(folder) / CONFIG_FILE).is_file() and \
        folder_model(module, folder).tie_word_embeddings
    return type(adapter)(adapter.args, tie_word_embeddings=True) if tied else adapter


def check_hf_folder(path: str, module: Any) -> None:
    """Before launch, the one check of the Hugging Face folder a fit loads (``checkpoint.initial_load_path``,
    ``initial_load_format=hf``; from ``check_initial_weights``): its config.json describes the run's
    model (family and args), its safetensors hold every tensor of the model in its shape and no file
    is shorter than its header says (the headers only: the model is built on the meta device), and
    the run has the model's tokenizer. One-line ConfigError naming the field, the tensor and both
    shapes, or the file and both sizes."""
    job, adapter_class = getattr(module, "job", None), getattr(module, "hf_adapter", None)
    if job is None or adapter_class is None or not hasattr(module, "build_model"):
        return  # a module of its own kind: its loader checks what it loads
    if (Path(path) / CONFIG_FILE).is_file():
        folder_model(module, path).check_matches(job.model, adapter_class)
    adapter = folder_adapter(module, path)
    with torch.device("meta"):
        model = module.build_model()
    try:
        with base_only(model) as base:  # (a LoRA run's adapters start where the folder stops)
            adapter.check_folder(base, path)
    except (OSError, ValueError) as err:
        if isinstance(err, ConfigError):
            raise
        raise ConfigError(f"checkpoint.initial_load_path={path!r}: {' '.join(str(err).split())}") from None
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
