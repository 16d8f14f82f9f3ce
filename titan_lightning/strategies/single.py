"""One parallelism each, for users who want exactly that: FSDP2 (with HSDP/DDP), TP, CP or EP."""

from typing import Any, Optional

from titan_lightning.config import ParallelismConfig
from titan_lightning.strategies.titan import TitanStrategy


class FSDP2Strategy(TitanStrategy):
    """Fully sharded data parallel (FSDP2) over ``dp_shard`` ranks, replicated over ``dp_replicate``.

    ``FSDP2Strategy()`` shards over every rank; ``dp_replicate=2`` makes it HSDP, and
    ``dp_shard=1, dp_replicate=N`` is DDP. Repeated blocks of a user's own module are
    found and sharded automatically.
    """

    strategy_name = "fsdp2"
    scope = ("dp_replicate", "dp_shard")

    def __init__(self, **kwargs: Any) -> None:
        fsdp_fields = ("dp_replicate", "dp_shard", "fsdp_reshard_after_forward", "fsdp_cpu_offload")
        degrees = {name: kwargs.pop(name) for name in fsdp_fields if name in kwargs}
        super().__init__(parallelism=ParallelismConfig(**degrees) if degrees else None, **kwargs)


class _OneDegreeStrategy(TitanStrategy):
    """A strategy of one degree (``_degree``) that takes every rank unless given; dp_shard=``_dp_shard``."""

    _degree: str
    _dp_shard = 1

    def __init__(self, options: dict[str, Any], **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self._options = options
        if options[self._degree] is not None:
            self._parallelism = self.default_parallelism()

    def default_parallelism(self) -> ParallelismConfig:
        options = dict(self._options)
        options[self._degree] = options[self._degree] or self.num_nodes * max(self.num_processes, 1)
        return ParallelismConfig(dp_shard=self._dp_shard, **options)


class TensorParallelStrategy(_OneDegreeStrategy):
    """Tensor parallel (with sequence and loss parallel) over ``tp`` ranks, every rank by default."""

    strategy_name = "tensor_parallel"
    scope = ("tp",)
    _degree = "tp"

    def __init__(
        self, *, tp: Optional[int] = None, sequence_parallel: bool = True, loss_parallel: bool = True, **kwargs: Any
    ) -> None:
        super().__init__(dict(tp=tp, sequence_parallel=sequence_parallel, loss_parallel=loss_parallel), **kwargs)


class ContextParallelStrategy(_OneDegreeStrategy):
    """Context parallel over ``cp`` ranks (every rank by default): each holds a load-balanced
    slice of every sequence; parameters are FSDP-sharded over the same ranks, as in torchtitan.

    The module's attention must be context parallel (``model.attention`` one of allgather,
    ring, ulysses; see ``ContextParallelTransform``).
    """

    strategy_name = "context_parallel"
    scope = ("cp",)
    _degree = "cp"

    def __init__(self, *, cp: Optional[int] = None, cp_load_balancer: Optional[str] = "headtail", **kwargs: Any) -> None:
        super().__init__(dict(cp=cp, cp_load_balancer=cp_load_balancer), **kwargs)


class ExpertParallelStrategy(_OneDegreeStrategy):
    """Expert parallel over ``ep`` ranks (every rank by default) on top of FSDP over every rank:
    the dense layers are FSDP-sharded as usual; each MoE layer's routed experts are split
    ``ep`` ways and FSDP-sharded over the remaining ``world / ep`` ranks, and tokens reach
    their experts by all-to-all. The module's model must have MoE layers (models/common/moe.py).
    """

    strategy_name = "expert_parallel"
    scope = ("dp_shard", "ep")
    _degree = "ep"
    _dp_shard = -1  # the dense layers: FSDP over every rank

    def __init__(self, *, ep: Optional[int] = None, **kwargs: Any) -> None:
        super().__init__(dict(ep=ep), **kwargs)


class PipelineParallelStrategy(_OneDegreeStrategy):
    """Pipeline parallel over ``pp`` ranks (every rank by default), one stage per rank (GPipe,
    1F1B) or several (the looped schedules), ``pp_microbatches`` per step.

    The module declares where its blocks are (``pipeline_plan``, see
    titan_lightning/parallel/pipeline.py); its ``training_step`` is unchanged: the strategy
    (titan_lightning/strategies/pipeline.py)
    runs forward and backward of every microbatch through the schedule and reports the last
    stage's loss and logs on every rank.
    """

    strategy_name = "pipeline_parallel"
    scope = ("pp",)
    _degree = "pp"

    def __init__(
        self, *, pp: Optional[int] = None, pp_schedule: str = "1F1B", pp_microbatches: Optional[int] = None,
        pp_stages_per_rank: Optional[int] = None, **kwargs: Any
    ) -> None:
        options = dict(pp=pp, pp_schedule=pp_schedule, pp_stages_per_rank=pp_stages_per_rank)
        if pp_microbatches is not None:
            options["pp_microbatches"] = pp_microbatches
        super().__init__(options, **kwargs)

    def default_parallelism(self) -> ParallelismConfig:
        config = super().default_parallelism()
        if "pp_microbatches" not in self._options:
            config.pp_microbatches = config.pp  # at least one microbatch per stage
            config.__post_init__()
        return config
