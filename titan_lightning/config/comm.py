"""How long a collective may wait before the run is called hung (parallel/watchdog.py), as torchtitan's
``comm``, and how long a rank on another host may be silent before it is called dead (parallel/heartbeat.py)."""

import math
from dataclasses import dataclass


@dataclass(kw_only=True)
class CommConfig:
    # Until the first optimizer step is done (process-group init, model setup, the first step's
    # compilation), a collective may wait this long for its peers.
    init_timeout_s: float = 300.0
    # After it: a collective waiting longer than this ends the run, naming the rank it waits for
    # and the collective (one line; every rank's Python stacks and flight recorder into the run folder).
    train_timeout_s: float = 100.0
    # Entries of torch's flight recorder per rank (TORCH_FR_BUFFER_SIZE): the collectives the watchdog
    # reads. 0 turns the recorder and the watchdog off (a hang then ends at the process group's timeout).
    trace_buf_size: int = 20000
    # A rank on another host whose heartbeat is silent this long is called dead (a rank on this host
    # is called dead only once its process is gone: silence alone, a stopped or swapping process, never).
    heartbeat_timeout_s: float = 60.0

    def __post_init__(self) -> None:
        for name in ("init_timeout_s", "train_timeout_s", "heartbeat_timeout_s"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
                raise ValueError(f"comm.{name}={value!r} must be a number of seconds > 0")
        if isinstance(self.trace_buf_size, bool) or not isinstance(self.trace_buf_size, int) or self.trace_buf_size < 0:
            raise ValueError(f"comm.trace_buf_size={self.trace_buf_size!r} must be an integer >= 0 (0: no flight "
                             f"recorder, no hang watchdog)")
