from titan_lightning.config.activation_checkpoint import ActivationCheckpointConfig
from titan_lightning.config.checkpoint import CheckpointConfig
from titan_lightning.config.comm import CommConfig
from titan_lightning.config.compile import CompileConfig
from titan_lightning.config.data import DataConfig, DataSource
from titan_lightning.config.job import JobConfig, ModelArgs
from titan_lightning.config.optimizer import LRScheduleConfig, OptimizerConfig
from titan_lightning.config.parallelism import ParallelismConfig
from titan_lightning.config.profiling import ProfilingConfig
from titan_lightning.config.quantize import Float8Config, QuantizeConfig
from titan_lightning.config.training import TrainingConfig
from titan_lightning.config.validation import ConfigError, validate_job

__all__ = [
    "ActivationCheckpointConfig",
    "CheckpointConfig",
    "CommConfig",
    "CompileConfig",
    "ConfigError",
    "DataConfig",
    "DataSource",
    "Float8Config",
    "JobConfig",
    "LRScheduleConfig",
    "ModelArgs",
    "OptimizerConfig",
    "ParallelismConfig",
    "ProfilingConfig",
    "QuantizeConfig",
    "TrainingConfig",
    "validate_job",
]
