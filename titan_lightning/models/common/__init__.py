from titan_lightning.models.common.attention import Attention
from titan_lightning.models.common.feedforward import FeedForward
from titan_lightning.models.common.init import canonical_fqn, init_params, param_generator
from titan_lightning.models.common.norms import RMSNorm
from titan_lightning.models.common.rope import RopeScaling, apply_rope, precompute_rope_cache, rope_frequencies

__all__ = [
    "Attention",
    "FeedForward",
    "RMSNorm",
    "RopeScaling",
    "apply_rope",
    "canonical_fqn",
    "init_params",
    "param_generator",
    "precompute_rope_cache",
    "rope_frequencies",
]
