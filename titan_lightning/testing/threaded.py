"""Run a function on N ranks that are threads of this process, with real data exchange.

torch's threaded process group (a test helper in ``torch.testing._internal``) implements the
collectives in Python on the tensors themselves, on any device. One GPU can so host a
multi-rank collective computation (NCCL refuses two ranks on one device), which is how the
context-parallel attention kernels are checked on a single H200. It is a test tool: slow, and
every rank shares this process's CUDA streams.
"""

import threading
from typing import Any, Callable

import torch.distributed as dist

from titan_lightning._compat import threaded_process_group


def run_threaded(fn: Callable[..., Any], world_size: int, timeout: float = 120.0, **kwargs) -> list[Any]:
    """``fn(rank, world_size, **kwargs)`` on ``world_size`` thread ranks; their results in rank order.

    The first exception of any rank is raised here (the others are woken, not left waiting);
    a rank still running after ``timeout`` seconds raises ``TimeoutError``.
    """
    ProcessLocalGroup, set_thread_isolation_mode, _install_threaded_pg, _uninstall_threaded_pg = threaded_process_group()

    if world_size < 1:
        raise ValueError(f"world_size={world_size}: must be at least 1")
    set_thread_isolation_mode(True)
    _install_threaded_pg()
    store = dist.HashStore()
    results: list[Any] = [None] * world_size
    errors: list[tuple[int, BaseException]] = []

    def body(rank: int) -> None:
        dist.init_process_group("threaded", rank=rank, world_size=world_size, store=store)
        try:
            results[rank] = fn(rank, world_size, **kwargs)
        except BaseException as error:  # noqa: BLE001 -- reported by the caller's thread
            errors.append((rank, error))
            ProcessLocalGroup.exception_handle(error)
        finally:
            dist.destroy_process_group()

    threads = [threading.Thread(target=body, args=(rank,), daemon=True) for rank in range(world_size)]
    try:
        for thread in threads:
            thread.start()
        for rank, thread in enumerate(threads):
            thread.join(timeout)
            if thread.is_alive():
                raise TimeoutError(f"thread rank {rank} of {world_size} still running after {timeout:.0f} s")
    finally:
        ProcessLocalGroup.reset()
        _uninstall_threaded_pg()
        set_thread_isolation_mode(False)
    if errors:
        rank, error = min(errors, key=lambda item: item[0])
        raise RuntimeError(f"thread rank {rank} of {world_size} failed: {error!r}") from error
    return results
