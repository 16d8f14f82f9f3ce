"""What a LoRA run's job may combine, checked before launch (``CausalLMModule.check_config``)."""

from importlib.util import find_spec
from typing import Any, Optional

from torch import nn

from titan_lightning.config import ConfigError
from titan_lightning.config.quantize import INSTALL
from titan_lightning.lora.parallel import check_lora_layout
from titan_lightning.lora.targets import lora_targets


def check_lora_job(job: Any, model: nn.Module, adapter: Optional[Any]) -> None:
    """One-line ConfigError for an unknown target or a combination adapters do not have yet;
    ``model``: the job's model built on the meta device, ``adapter``: its family's state-dict adapter."""
    lora = job.lora
    if not lora.enabled:
        return
    check_lora_layout(job, model)
    if job.quantize.float8.enable:
        raise ConfigError(f"lora.rank={lora.rank} with quantize.float8.enable=True: float8 base linears with "
                          f"adapters are not built; set quantize.float8.enable=False")
    if lora.quantize_base is not None:
        p = job.parallelism
        spread = [f"parallelism.{name}={getattr(p, name)}"
                  for name in ("tp", "pp", "ep", "dp_shard", "dp_replicate", "cp") if getattr(p, name) not in (1, -1)]
        if spread:
            raise ConfigError(f"lora.quantize_base={lora.quantize_base!r} with {spread[0]}: an NF4 base trains on one "
                              f"process for now; set lora.quantize_base=None, or {spread[0].split('=')[0]}=1")
        if find_spec("torchao") is None:
            raise ConfigError(f"lora.quantize_base={lora.quantize_base!r} needs torchao, which is not installed: "
                              f"{INSTALL}")
    c = job.checkpoint
    if c.initial_load_path is not None and c.initial_load_format != "hf":
        raise ConfigError(f"lora.rank={lora.rank} with checkpoint.initial_load_format={c.initial_load_format!r}: "
                          f"adapters start from a Hugging Face base folder; set initial_load_format=hf")
    try:
        lora_targets(model, adapter, lora)
    except ValueError as err:
        raise ConfigError(str(err)) from None
