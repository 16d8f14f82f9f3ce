"""The whole configuration of one run, minus the Trainer's own arguments."""

from dataclasses import dataclass, field
from typing import Optional

from titan_lightning.config.activation_checkpoint import ActivationCheckpointConfig
from titan_lightning.config.checkpoint import CheckpointConfig
from titan_lightning.config.comm import CommConfig
from titan_lightning.config.compile import CompileConfig
from titan_lightning.config.data import DataConfig
from titan_lightning.config.lora import LoRAConfig
from titan_lightning.config.optimizer import LRScheduleConfig, OptimizerConfig
from titan_lightning.config.parallelism import ParallelismConfig
from titan_lightning.config.preference import PreferenceConfig
from titan_lightning.config.profiling import ProfilingConfig
from titan_lightning.config.quantize import QuantizeConfig
from titan_lightning.config.training import TrainingConfig

# Attention implementations: kernels over the local sequence (models/common/masking.py) and
# context-parallel backends (parallel/context.py).
KERNEL_ATTENTIONS = ("sdpa", "flex", "varlen")
CP_ATTENTIONS = ("allgather", "ring", "ulysses")
ATTENTIONS = (*KERNEL_ATTENTIONS, *CP_ATTENTIONS)
MASKS = ("causal", "block_causal")
POSITIONS = ("global", "per_document")
LAYER_TYPES = ("full_attention", "sliding_attention")  # Hugging Face's names


@dataclass(kw_only=True)
class ModelArgs:
    """Architecture of a model; each family subclasses it with its own fields."""

    vocab_size: int = 2048
    n_heads: int = 16
    n_kv_heads: int = 16
    # A kernel over the local sequence (no context parallelism): "sdpa", "flex" (FlexAttention,
    # GPU) or "varlen" (variable-length FlashAttention, CUDA); or a context-parallel backend
    # ("allgather", "ring", "ulysses"), set by ContextParallelTransform, for parallelism.cp > 1.
    attention: str = "sdpa"
    # "causal", or "block_causal": each token attends only within its document of the packed
    # window; "global" RoPE positions, or "per_document" ones (models/common/masking.py).
    mask: str = "causal"
    positions: str = "global"
    # Sliding-window attention, as Hugging Face's ``sliding_window``: a query at i sees the keys j
    # with i - sliding_window < j <= i (and, with block_causal, only those of its document).
    # ``layer_types`` names each layer's attention, "full_attention" or "sliding_attention";
    # None with a window: every layer slides (models/common/masking.py).
    sliding_window: Optional[int] = None
    layer_types: Optional[list[str]] = None

    def __post_init__(self) -> None:
        if self.attention not in ATTENTIONS:
            raise ValueError(f"model.attention={self.attention!r} is not one of {', '.join(ATTENTIONS)}")
        if self.mask not in MASKS:
            raise ValueError(f"model.mask={self.mask!r} is not one of {', '.join(MASKS)}")
        if self.positions not in POSITIONS:
            raise ValueError(f"model.positions={self.positions!r} is not one of {', '.join(POSITIONS)}")
        if self.sliding_window is not None:
            self.require_positive_ints("sliding_window")
        unknown = [t for t in self.layer_types or () if t not in LAYER_TYPES]
        if unknown:
            raise ValueError(f"model.layer_types has {unknown[0]!r}, which is not one of {', '.join(LAYER_TYPES)}")
        self.require_positive_ints("vocab_size", "n_heads", "n_kv_heads")
        if self.n_heads % self.n_kv_heads:
            raise ValueError(
                f"model.n_heads={self.n_heads} must be a multiple of model.n_kv_heads={self.n_kv_heads}"
            )

    def attention_window(self, layer_id: int) -> Optional[int]:
        """The sliding window of layer ``layer_id``'s attention; None: it attends to the whole window."""
        if self.sliding_window is None or (self.layer_types is not None
                                           and self.layer_types[layer_id] != "sliding_attention"):
            return None
        return self.sliding_window

    def require_positive_ints(self, *names: str, minimum: int = 1) -> None:
        for name in names:
            value = getattr(self, name)
            if not isinstance(value, int) or value < minimum:
                what = "a positive integer" if minimum == 1 else f"an integer >= {minimum}"
                raise ValueError(f"model.{name}={value!r} must be {what}")

    def require_positive(self, *names: str) -> None:
        """Fields that must be > 0 (None passes: an optional field left unset)."""
        for name in names:
            value = getattr(self, name)
            if value is not None and not value > 0:
                raise ValueError(f"model.{name}={value!r} must be > 0")


@dataclass(kw_only=True)
class JobConfig:
    """Every section a run reads. A model family narrows ``model`` to its own args class."""

    model: ModelArgs = field(default_factory=ModelArgs)
    training: TrainingConfig = field(default_factory=TrainingConfig)
    parallelism: ParallelismConfig = field(default_factory=ParallelismConfig)
    optimizer: OptimizerConfig = field(default_factory=OptimizerConfig)
    lr_schedule: LRScheduleConfig = field(default_factory=LRScheduleConfig)
    data: DataConfig = field(default_factory=DataConfig)
    activation_checkpoint: ActivationCheckpointConfig = field(default_factory=ActivationCheckpointConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    compile: CompileConfig = field(default_factory=CompileConfig)
    quantize: QuantizeConfig = field(default_factory=QuantizeConfig)
    lora: LoRAConfig = field(default_factory=LoRAConfig)
    preference: PreferenceConfig = field(default_factory=PreferenceConfig)
    profiling: ProfilingConfig = field(default_factory=ProfilingConfig)
    comm: CommConfig = field(default_factory=CommConfig)

    def check_family(self) -> None:
        """The model family's own rules (its Hugging Face export, ...), run by ``validate_job``; a
        family's job class (``models/family.py``: ``define_family``) runs its module's ``check_config``."""
