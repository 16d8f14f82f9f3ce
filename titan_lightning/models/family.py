"""A model family's job and LightningModule, declared in one statement (``models/<family>/module.py``)::

    Llama3Job, Llama3Module = define_family("Llama3", Llama3Args, Llama3StateDictAdapter, module=__name__,
                                            doc="Llama 3 (dense, GQA, ...).")

The family itself is its args class (whose ``Decoder`` registers it: models/common/decoder.py)
and its Hugging Face adapter (models/common/hf_checkpoint.py); this file writes the rest once.
"""

from dataclasses import field, make_dataclass
from typing import Optional

from titan_lightning.config import JobConfig, ModelArgs
from titan_lightning.models.causal_lm import CausalLMModule


def define_family(name: str, args: type[ModelArgs], adapter: Optional[type] = None, *, module: str,
                  doc: Optional[str] = None) -> tuple[type[JobConfig], type[CausalLMModule]]:
    """``(<name>Job, <name>Module)``: a ``JobConfig`` whose ``model`` is an ``args`` (the CLI's
    types come from it) and a ``CausalLMModule`` whose ``hf_adapter`` is ``adapter``, both living
    in the Python module named ``module`` (pass ``__name__``: pickle and the CLI find them there).
    The job's ``check_family`` (``validate_job`` calls it) runs the module's ``check_config``."""

    def check_family(job: JobConfig) -> None:
        module_class.check_config(job)

    job_class = make_dataclass(f"{name}Job", [("model", args, field(default_factory=args))], bases=(JobConfig,),
                               namespace={"check_family": check_family}, kw_only=True)
    job_class.__module__ = module
    job_class.__doc__ = f"A {name} run's job: ``model`` is a ``{args.__name__}``."
    module_class = type(f"{name}Module", (CausalLMModule,), {
        "__module__": module, "__doc__": doc, "__annotations__": {"job": job_class}, "hf_adapter": adapter,
    })
    return job_class, module_class
