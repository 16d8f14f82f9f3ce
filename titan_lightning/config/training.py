"""How a run trains: batch budget, seed, determinism, precision, clipping."""

from dataclasses import dataclass
from typing import Literal, Optional

DTYPES = ("float32", "bfloat16")


@dataclass(kw_only=True)
class TrainingConfig:
    """Training settings shared by every model.

    The number of steps is Lightning's ``trainer.max_steps``; it is not repeated here.
    """

    seed: int = 0
    seq_len: int = 2048
    tokens_per_microbatch_per_dp_rank: int = 8192
    # None: one microbatch per data-parallel rank per step (no gradient accumulation).
    tokens_per_step: Optional[int] = None
    # Deterministic algorithms, fixed CPU thread count, bitwise-identical reruns.
    deterministic: bool = False
    # Torch threads per process on CPU; None: torch's choice, or 1 in deterministic mode
    # (a reduction split over another number of threads sums in another order).
    cpu_threads: Optional[int] = None
    # dtype the parameters are stored in ("bfloat16" is full-bf16 training).
    dtype: Literal["float32", "bfloat16"] = "float32"
    # dtype the forward and backward compute in (bf16 autocast / FSDP param dtype).
    mixed_precision_param: Literal["float32", "bfloat16"] = "float32"
    # dtype gradients are reduced in across data-parallel ranks (FSDP).
    mixed_precision_reduce: Literal["float32", "bfloat16"] = "float32"
    # None: no clipping (the grad norm is still computed and logged).
    max_grad_norm: Optional[float] = 1.0
    # None: the head returns full logits and the loss upcasts them to fp32. N: the head and the
    # cross-entropy run together over N chunks of the tokens, never holding full logits (the
    # same loss and gradients; the memory of one chunk's logits instead of all of them).
    loss_chunks: Optional[int] = None

    def __post_init__(self) -> None:
        _positive("training.seq_len", self.seq_len)
        _positive("training.tokens_per_microbatch_per_dp_rank", self.tokens_per_microbatch_per_dp_rank)
        if self.tokens_per_microbatch_per_dp_rank % self.seq_len:
            raise ValueError(
                f"training.tokens_per_microbatch_per_dp_rank={self.tokens_per_microbatch_per_dp_rank} "
                f"must be a multiple of training.seq_len={self.seq_len}"
            )
        if self.tokens_per_step is not None:
            _positive("training.tokens_per_step", self.tokens_per_step)
            if self.tokens_per_step % self.tokens_per_microbatch_per_dp_rank:
                raise ValueError(
                    f"training.tokens_per_step={self.tokens_per_step} must be a multiple of "
                    f"training.tokens_per_microbatch_per_dp_rank={self.tokens_per_microbatch_per_dp_rank}"
                )
        if self.cpu_threads is not None:
            _positive("training.cpu_threads", self.cpu_threads)
        chunks = self.loss_chunks
        if chunks is not None and (isinstance(chunks, bool) or not isinstance(chunks, int) or chunks < 1):
            raise ValueError(
                f"training.loss_chunks={self.loss_chunks!r} must be a positive integer (chunks of the tokens), "
                f"or None for the plain loss on full logits"
            )
        if self.max_grad_norm is not None and not self.max_grad_norm > 0:
            raise ValueError(f"training.max_grad_norm={self.max_grad_norm} must be > 0, or None to disable clipping")
        if self.dtype == "bfloat16" and self.mixed_precision_param == "float32":
            raise ValueError(
                "training.mixed_precision_param='float32' cannot compute in fp32 with training.dtype='bfloat16' "
                "parameters; use mixed_precision_param='bfloat16'"
            )

    @property
    def microbatch_size(self) -> int:
        """Sequences per microbatch on one data-parallel rank."""
        return self.tokens_per_microbatch_per_dp_rank // self.seq_len


def _positive(name: str, value: int) -> None:
    if not isinstance(value, int) or value <= 0:
        raise ValueError(f"{name}={value!r} must be a positive integer")
