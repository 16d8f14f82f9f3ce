"""FakePGStrategy: simulate any world size in one process (CPU or one GPU)."""

from typing import Any, Optional

import lightning as L
import torch.distributed as dist
from lightning.pytorch.utilities.rank_zero import rank_zero_only
from lightning_utilities.core.rank_zero import rank_zero_only as utils_rank_zero_only

from titan_lightning.config import ConfigError
from titan_lightning.parallel.fake import deterministic_collectives, init_fake_process_group, memory_report
from titan_lightning.parallel.mesh import release_dtensor_caches
from titan_lightning.strategies.titan import TitanStrategy


class FakePGStrategy(TitanStrategy):
    """TitanStrategy over torch's fake process group: one process is rank ``rank`` of ``world_size``.

    It builds the same mesh and applies the same parallelisms as a real run, trains the
    configured steps, and prints the degrees and this rank's parameter, gradient and
    optimizer-state bytes (``memory`` holds them afterwards). Checkpointing and pipeline
    parallelism are refused: fake collectives move no data.

    ``world_size=None`` takes the Trainer's ``devices * num_nodes``.
    """

    strategy_name = "fake_pg"
    # No pipeline (torch's schedules cannot run on fake collectives) and no DDP: it only
    # all-reduces gradients, which moves no data here, and its C++ reducer rejects the fake
    # group's empty futures (parameters stay replicated as under DDP).
    fake_pg = True

    def __init__(self, world_size: Optional[int] = None, rank: int = 0, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        if world_size is not None and world_size < 1:
            raise ValueError(f"FakePGStrategy(world_size={world_size}) must be >= 1")
        if world_size is not None and not 0 <= rank < world_size:
            raise ValueError(f"FakePGStrategy(rank={rank}) must be in [0, world_size={world_size})")
        self._fake_world_size = world_size
        self._fake_rank = rank
        self.memory: Optional[dict[str, int]] = None

    @property
    def world_size(self) -> int:
        return self._fake_world_size or self.num_nodes * max(self.num_processes, 1)

    @property
    def global_rank(self) -> int:
        return self._fake_rank

    @property
    def local_rank(self) -> int:
        return 0

    @property
    def root_device(self):
        return self.parallel_devices[0]

    def set_world_ranks(self) -> None:
        # Process-wide: put back at teardown, or a later Trainer in this process would log nothing.
        if not hasattr(self, "_rank_zero_before"):
            self._rank_zero_before = (getattr(rank_zero_only, "rank", 0), getattr(utils_rank_zero_only, "rank", 0))
        rank_zero_only.rank = utils_rank_zero_only.rank = self._fake_rank

    def _configure_launcher(self) -> None:
        self._check_own_degrees(self.world_size)
        self._launcher = None  # one process, whatever the simulated world size

    def _setup_distributed(self) -> None:
        self.accelerator.setup_device(self.root_device)
        self._process_group_backend = "fake"
        init_fake_process_group(self._fake_rank, self.world_size)
        self._collectives = deterministic_collectives().__enter__()

    def teardown(self) -> None:
        super().teardown()
        # The simulated group is this run's own (nothing after it can use a fake world): it goes with the run.
        if dist.is_initialized() and dist.get_backend() == "fake":
            dist.destroy_process_group()
            release_dtensor_caches()
        if getattr(self, "_collectives", None) is not None:
            self._collectives.__exit__(None, None, None)
            self._collectives = None
        if hasattr(self, "_rank_zero_before"):
            rank_zero_only.rank, utils_rank_zero_only.rank = self._rank_zero_before
            del self._rank_zero_before

    def setup_environment(self) -> None:
        trainer = self.lightning_module.trainer
        if trainer.checkpoint_callbacks:
            raise ConfigError(
                "checkpointing cannot run under the fake process group (its collectives move no data); "
                "set trainer.enable_checkpointing=False"
            )
        super().setup_environment()

    def optimizer_step(self, optimizer, closure, model=None, **kwargs: Any) -> Any:
        output = super().optimizer_step(optimizer, closure, model, **kwargs)
        # Counted here, while the gradients exist: CausalLMModule frees them after the step.
        self.memory = memory_report(self.model, self.optimizers)
        return output

    def on_train_end(self) -> None:
        if self.memory is None:  # no optimizer step ran
            self.memory = memory_report(self.model, self.optimizers)
        mib = {k: v / 2**20 for k, v in self.memory.items()}
        print(
            f"[fake_pg] world_size={self.world_size} rank={self._fake_rank} {self.dims.describe()}: "
            f"parameters {mib['parameters']:.2f} MiB, gradients {mib['gradients']:.2f} MiB, "
            f"optimizer state {mib['optimizer_state']:.2f} MiB",
            flush=True,
        )

    def barrier(self, name: Optional[str] = None) -> None:
        pass

    def broadcast(self, obj: Any, src: int = 0) -> Any:
        return obj  # no data moves; every simulated rank already holds the same value
