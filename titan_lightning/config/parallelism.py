"""Parallel degrees of a run. The world size comes from the launch; see validation.py."""

from dataclasses import dataclass
from typing import Optional

PP_SCHEDULES = (
    "GPipe",
    "1F1B",
    "Interleaved1F1B",
    "LoopedBFS",
    "InterleavedZeroBubble",
    "ZBVZeroBubble",
)
LOOPED_PP_SCHEDULES = ("Interleaved1F1B", "LoopedBFS", "InterleavedZeroBubble", "ZBVZeroBubble")
# Schedules whose two stages per rank sit in a V (rank r: stages r and 2*pp-1-r).
V_PP_SCHEDULES = ("ZBVZeroBubble",)
CP_LOAD_BALANCERS = ("headtail", "ptrr")
FSDP_RESHARD_POLICIES = ("default", "always", "never")
# How expert parallelism sizes its token all-to-alls (parallel/expert.py): exact splits read on
# the host once per MoE layer, or fixed worst-case blocks with no host read (ep x the traffic).
EP_DISPATCHES = ("splits", "padded")


@dataclass(kw_only=True)
class ParallelismConfig:
    """Degrees of each parallelism (1 means off)."""

    dp_replicate: int = 1
    # -1: every rank left after the other degrees.
    dp_shard: int = -1
    tp: int = 1
    sequence_parallel: bool = True
    # Vocab-sharded logits go straight into the loss (full logits are never gathered).
    loss_parallel: bool = True
    pp: int = 1
    pp_schedule: str = "1F1B"
    # Microbatches the local batch is split into for the pipeline (per step, per dp rank).
    pp_microbatches: int = 1
    # Stages per pipeline rank; None: 1 for GPipe/1F1B, 2 for the looped schedules.
    pp_stages_per_rank: Optional[int] = None
    # Automatic split: the embedding and the output head count as this many layers each.
    pp_first_stage_weight: int = 1
    pp_last_stage_weight: int = 1
    # Explicit split: module names per stage, e.g. [["tok_embeddings", "layers.0"], ["layers.1", "norm", "output"]].
    pp_stage_modules: Optional[list[list[str]]] = None
    # A schedule from a CSV file (torch's compute-only format, one row of actions per rank).
    pp_schedule_csv: Optional[str] = None
    cp: int = 1
    cp_load_balancer: Optional[str] = "headtail"
    ep: int = 1
    # "splits": exact sizes, one host read per MoE layer; "padded": no host read, every rank
    # sends every rank a worst-case block (ep times the traffic and receive memory).
    ep_dispatch: str = "splits"
    # FSDP: free the unsharded parameters after forward ("default": every block but the
    # last, whose backward runs first), always, or never (more memory, less communication).
    fsdp_reshard_after_forward: str = "default"
    fsdp_cpu_offload: bool = False
    # With gradient accumulation: reduce-scatter the gradients only after the last microbatch
    # of each step (unsharded gradients accumulate locally: less communication, more memory).
    fsdp_sync_last_microbatch_only: bool = False

    def __post_init__(self) -> None:
        for name in ("dp_replicate", "tp", "pp", "cp", "ep", "pp_microbatches", "pp_stages_per_rank"):
            if name == "pp_stages_per_rank" and self.pp_stages_per_rank is None:
                continue
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"parallelism.{name}={value!r} must be an integer >= 1")
        if not isinstance(self.dp_shard, int) or (self.dp_shard < 1 and self.dp_shard != -1):
            raise ValueError(f"parallelism.dp_shard={self.dp_shard!r} must be -1 (the rest) or an integer >= 1")
        if self.pp_schedule not in PP_SCHEDULES:
            raise ValueError(f"parallelism.pp_schedule={self.pp_schedule!r} is not one of {', '.join(PP_SCHEDULES)}")
        for name in ("pp_first_stage_weight", "pp_last_stage_weight"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 0:
                raise ValueError(f"parallelism.{name}={value!r} must be an integer >= 0")
        if self.fsdp_reshard_after_forward not in FSDP_RESHARD_POLICIES:
            raise ValueError(
                f"parallelism.fsdp_reshard_after_forward={self.fsdp_reshard_after_forward!r} is not one of "
                f"{', '.join(FSDP_RESHARD_POLICIES)}"
            )
        if self.ep_dispatch not in EP_DISPATCHES:
            raise ValueError(f"parallelism.ep_dispatch={self.ep_dispatch!r} is not one of {', '.join(EP_DISPATCHES)}")
        if self.cp_load_balancer is not None and self.cp_load_balancer not in CP_LOAD_BALANCERS:
            raise ValueError(
                f"parallelism.cp_load_balancer={self.cp_load_balancer!r} is not one of "
                f"{', '.join(CP_LOAD_BALANCERS)} or None"
            )

    @property
    def stages_per_rank(self) -> int:
        """Pipeline stages on each pipeline rank (1 for GPipe/1F1B unless set, else 2 unless set)."""
        if self.pp_stages_per_rank is not None:
            return self.pp_stages_per_rank
        return 2 if self.pp_schedule in LOOPED_PP_SCHEDULES else 1

    @property
    def num_stages(self) -> int:
        return self.pp * self.stages_per_rank

    @property
    def fixed_degrees(self) -> int:
        """Product of every degree but dp_shard (and ep, which borrows ranks)."""
        return self.dp_replicate * self.tp * self.pp * self.cp

    @property
    def seq_len_divisor(self) -> int:
        """What every sequence length must be a multiple of: cp (2*cp with the headtail load
        balancer), times tp under sequence parallelism."""
        cp_part = 2 * self.cp if self.cp > 1 and self.cp_load_balancer == "headtail" else self.cp
        return cp_part * (self.tp if self.sequence_parallel and self.tp > 1 else 1)

    def resolved_dp_shard(self, world_size: int) -> int:
        """dp_shard with -1 replaced by the ranks left over; no checks (see validation.py)."""
        if self.dp_shard != -1:
            return self.dp_shard
        return max(world_size // self.fixed_degrees, 1)

    def degrees(self, world_size: int) -> dict[str, int]:
        """Degrees in mesh order, outermost first."""
        return {
            "pp": self.pp,
            "dp_replicate": self.dp_replicate,
            "dp_shard": self.resolved_dp_shard(world_size),
            "cp": self.cp,
            "tp": self.tp,
        }
