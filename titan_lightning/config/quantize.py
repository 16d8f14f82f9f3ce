"""Low-precision training: float8 linears through torchao (parallel/float8.py)."""

from dataclasses import dataclass, field
from importlib.util import find_spec

RECIPES = ("tensorwise", "rowwise")
INSTALL = 'pip install -e ".[float8]"'


@dataclass(kw_only=True)
class Float8Config:
    # Swap the model's nn.Linear layers for torchao's Float8Linear (matmuls in float8, weights,
    # optimizer and everything else as before). Needs torchao (the `float8` extra), and on a GPU
    # SM89 or newer (Ada, Hopper, Blackwell) and compile.enable; MoE routed experts stay bf16.
    # With LoRA (job.lora) the adapted linears keep their frozen base and compute it in float8.
    enable: bool = False
    # torchao's scaling: "tensorwise" (one scale per tensor; fastest) or "rowwise" (one per row;
    # closer to bf16, power-of-two scales).
    recipe: str = "tensorwise"
    # torchao's emulation: operands rounded to float8 with the recipe's scales, matmuls in high
    # precision, no float8 kernels. What runs on a CPU (the tests) or a GPU older than SM89; never fast.
    emulate: bool = False
    # FSDP all-gathers the weights already cast to float8 (half of bf16's bytes); tensorwise only.
    enable_fsdp_float8_all_gather: bool = False
    # With the float8 all-gather: every weight's scale computed after the optimizer step in one
    # all-reduce for the whole model, instead of one per weight at its all-gather.
    precompute_float8_dynamic_scale_for_fsdp: bool = False
    # Linears left in high precision: a name matches whole dotted parts of a module's name
    # ("output" is the head, "router.gate" every MoE router's gate, "layers.0" a whole block).
    filter_fqns: list[str] = field(default_factory=lambda: ["output", "router.gate"])
    # Linears with a dimension below this stay in high precision (the casts cost more than
    # float8 saves on small matmuls); dimensions not divisible by 16 always do (float8 kernels).
    min_dim: int = 0

    @property
    def float8_tensor_parallel(self) -> bool:
        """Tensor parallelism shards the float8 linears with torchao's float8 styles (which cast
        before their collectives, per tensor): the tensorwise recipe only, as torchtitan does."""
        return self.enable and self.recipe == "tensorwise"

    def __post_init__(self) -> None:
        if self.recipe not in RECIPES:
            raise ValueError(f"quantize.float8.recipe={self.recipe!r} is not one of {', '.join(RECIPES)}")
        if self.enable_fsdp_float8_all_gather and self.recipe != "tensorwise":
            raise ValueError(
                f"quantize.float8.enable_fsdp_float8_all_gather=True needs recipe='tensorwise' (torchao casts "
                f"weights for the all-gather per tensor), got recipe={self.recipe!r}"
            )
        if self.precompute_float8_dynamic_scale_for_fsdp and not self.enable_fsdp_float8_all_gather:
            raise ValueError(
                "quantize.float8.precompute_float8_dynamic_scale_for_fsdp=True precomputes the scales of the "
                "float8 all-gather; set quantize.float8.enable_fsdp_float8_all_gather=True too"
            )
        if not isinstance(self.min_dim, int) or isinstance(self.min_dim, bool) or self.min_dim < 0:
            raise ValueError(f"quantize.float8.min_dim={self.min_dim!r} must be an integer >= 0")
        if self.enable and find_spec("torchao") is None:
            raise ValueError(f"quantize.float8.enable=True needs torchao, which is not installed: {INSTALL}")


@dataclass(kw_only=True)
class QuantizeConfig:
    float8: Float8Config = field(default_factory=Float8Config)

    def __post_init__(self) -> None:
        if isinstance(self.float8, dict):
            self.float8 = Float8Config(**self.float8)
        self.float8.__post_init__()
