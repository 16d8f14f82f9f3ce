"""Lightning strategies: TitanStrategy composes the parallelisms; FakePG simulates a world size."""

from lightning.pytorch.strategies import StrategyRegistry

from titan_lightning.strategies.fake import FakePGStrategy
from titan_lightning.strategies.single import (
    ContextParallelStrategy,
    ExpertParallelStrategy,
    FSDP2Strategy,
    PipelineParallelStrategy,
    TensorParallelStrategy,
)
from titan_lightning.strategies.titan import TitanStrategy

for _cls, _description in (
    (TitanStrategy, "titan_lightning N-D parallelism (degrees from the module's job or the strategy)"),
    (FSDP2Strategy, "titan_lightning FSDP2 / HSDP / DDP over every rank"),
    (TensorParallelStrategy, "titan_lightning tensor parallel over every rank"),
    (ContextParallelStrategy, "titan_lightning context parallel over every rank"),
    (ExpertParallelStrategy, "titan_lightning expert parallel (MoE experts) over every rank, FSDP for the rest"),
    (PipelineParallelStrategy, "titan_lightning pipeline parallel over every rank (torch.distributed.pipelining)"),
    (FakePGStrategy, "titan_lightning fake process group: simulate devices*num_nodes ranks in one process"),
):
    if _cls.strategy_name not in StrategyRegistry:
        StrategyRegistry.register(_cls.strategy_name, _cls, description=_description)

__all__ = [
    "ContextParallelStrategy", "ExpertParallelStrategy", "FSDP2Strategy", "FakePGStrategy", "PipelineParallelStrategy",
    "TensorParallelStrategy", "TitanStrategy",
]
