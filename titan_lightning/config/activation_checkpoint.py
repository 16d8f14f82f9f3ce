"""Which activations a run keeps for the backward (parallel/activation_checkpoint.py)."""

from dataclasses import dataclass

MODES = ("none", "full", "selective")
PER_OP_OPTIONS = ("op", "op_lean")


@dataclass(kw_only=True)
class ActivationCheckpointConfig:
    # "none", "full" (recompute every block), "selective" (see selective_ac_option).
    mode: str = "none"
    # With mode="selective": "op" saves matmul/attention outputs and recomputes the rest in
    # every block; "op_lean" also recomputes every second matmul of a block (torchtitan's "op":
    # less memory, more compute); an integer "N" fully checkpoints every N-th block.
    selective_ac_option: str = "op"

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise ValueError(f"activation_checkpoint.mode={self.mode!r} is not one of {', '.join(MODES)}")
        option = str(self.selective_ac_option)
        if option not in PER_OP_OPTIONS and not (option.isdigit() and int(option) >= 1):
            raise ValueError(
                f"activation_checkpoint.selective_ac_option={self.selective_ac_option!r} must be 'op', "
                f"'op_lean' or a positive integer N (checkpoint every N-th block)"
            )
        self.selective_ac_option = option
