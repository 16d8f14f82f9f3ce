"""The model families, listed once (as torchtitan's ``models/__init__.py`` lists its models).

A family is a package under models/ whose ``module.py`` declares ``<Stem>Job, <Stem>Module``
(models/family.py); a Hugging Face folder finds its family by config.json's ``model_type``, one of
the values its adapter reads (``hf_model_types``). A new family adds one line to ``FAMILIES``.
"""

from importlib import import_module

# package under models/ -> the stem of its job and module classes; in the order a refusal lists them.
FAMILIES = {
    "llama3": "Llama3",
    "qwen3": "Qwen3",
    "deepseek_v3": "DeepSeekV3",
    "qwen2": "Qwen2",
    "mistral": "Mistral",
    "gpt_oss": "GptOss",
    "gemma3": "Gemma3",
    "phi3": "Phi3",
    "olmo2": "Olmo2",
}


def family(package: str) -> tuple[type, type]:
    """(the JobConfig, the LightningModule) of ``models/<package>``."""
    module = import_module(f"titan_lightning.models.{package}.module")
    stem = FAMILIES[package]
    return getattr(module, f"{stem}Job"), getattr(module, f"{stem}Module")


def hf_families() -> dict[str, tuple[type, type]]:
    """config.json ``model_type`` -> (the family's JobConfig, its LightningModule)."""
    found: dict[str, tuple[type, type]] = {}
    for package in FAMILIES:
        job_class, module_class = family(package)
        found.update(dict.fromkeys(module_class.hf_adapter.hf_model_types, (job_class, module_class)))
    return found
