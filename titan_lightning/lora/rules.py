"""What a LoRA run's job may combine, checked before launch (``CausalLMModule.check_config``)."""

from importlib.util import find_spec
from typing import Any, Optional

from torch import nn

from titan_lightning.config import ConfigError
from titan_lightning.config.quantize import INSTALL
from titan_lightning.lora.layer import NF4_BLOCK, nf4_scaler_block
from titan_lightning.lora.parallel import check_lora_layout
from titan_lightning.lora.targets import lora_targets
from titan_lightning.parallel.nf4 import uneven_split


def check_lora_job(job: Any, model: nn.Module, adapter: Optional[Any]) -> None:
    """One-line ConfigError for an unknown target or a combination adapters do not have yet;
    ``model``: the job's model built on the meta device, ``adapter``: its family's state-dict adapter."""
    lora = job.lora
    if not lora.enabled:
        return
    check_lora_layout(job, model)
    if job.quantize.float8.enable:
        check_float8_base(job)
    if lora.quantize_base is not None:
        check_nf4_layout(job.parallelism, lora.quantize_base)
        if find_spec("torchao") is None:
            raise ConfigError(f"lora.quantize_base={lora.quantize_base!r} needs torchao, which is not installed: "
                              f"{INSTALL}")
    c = job.checkpoint
    if c.initial_load_path is not None and c.initial_load_format != "hf":
        raise ConfigError(f"lora.rank={lora.rank} with checkpoint.initial_load_format={c.initial_load_format!r}: "
                          f"adapters start from a Hugging Face base folder; set initial_load_format=hf")
    try:
        targets = lora_targets(model, adapter, lora)
    except ValueError as err:
        raise ConfigError(str(err)) from None
    if lora.quantize_base is not None and job.parallelism.dp_shard > 1:
        check_nf4_shards(model, list(targets), job.parallelism.dp_shard)


def check_float8_base(job: Any) -> None:
    """Adapters over float8 base linears (parallel/float8.py): one process, FSDP2 / HSDP, CP, PP, EP;
    a one-line ConfigError for what they do not combine with."""
    lora, f8, tp = job.lora, job.quantize.float8, job.parallelism.tp
    if lora.quantize_base is not None:
        raise ConfigError(f"lora.quantize_base={lora.quantize_base!r} with quantize.float8.enable=True: an NF4 base "
                          f"has no float8 matmul; set lora.quantize_base=None or quantize.float8.enable=False")
    if tp > 1:
        raise ConfigError(f"quantize.float8.enable=True with lora.rank={lora.rank} and parallelism.tp={tp}: adapters "
                          f"over float8 base linears are built for one process, FSDP2 / HSDP, CP, PP and EP, not "
                          f"tensor parallelism; set parallelism.tp=1 or quantize.float8.enable=False")
    if f8.enable_fsdp_float8_all_gather:
        raise ConfigError(f"quantize.float8.enable_fsdp_float8_all_gather=True with lora.rank={lora.rank}: a LoRA "
                          f"run's frozen base is all-gathered in its own dtype and cast to float8 at each matmul; set "
                          f"quantize.float8.enable_fsdp_float8_all_gather=False")


def check_nf4_layout(p: Any, quantize: str) -> None:
    """QLoRA's layouts: one process, FSDP2 (dp_shard) and HSDP, the NF4 base sharded on its rows
    (parallel/nf4.py); one-line ConfigError for any other degree."""
    spread = [f"parallelism.{name}={getattr(p, name)}" for name in ("tp", "pp", "ep", "cp") if getattr(p, name) != 1]
    if p.dp_replicate > 1 and p.dp_shard == 1:
        spread.append(f"parallelism.dp_replicate={p.dp_replicate}")
    if spread:
        raise ConfigError(f"lora.quantize_base={quantize!r} with {spread[0]}: an NF4 base trains on one process or "
                          f"sharded by FSDP2 / HSDP (dp_shard) alone; set lora.quantize_base=None, or "
                          f"{spread[0].split('=')[0]}=1")


def check_nf4_shards(model: nn.Module, targets: list[str], dp_shard: int) -> None:
    """Each rank of ``dp_shard`` keeps whole rows and whole scale blocks of every NF4 weight
    (parallel/nf4.py ``uneven_split``): a one-line ConfigError naming the first weight that does not
    split so."""
    for name in targets:
        rows, columns = model.get_submodule(name).weight.shape
        scale_blocks = rows * columns // NF4_BLOCK // nf4_scaler_block(rows * columns)
        problem = uneven_split(f"{name}.weight", (rows, columns), scale_blocks, dp_shard)
        if problem is not None:
            raise ConfigError(problem)
