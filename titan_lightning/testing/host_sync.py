"""``forbid_host_sync()``: code that must never wait for the device fails where it reads a value.

On a GPU every read of a tensor's value on the host (``.item()``, ``.tolist()``, ``int(t)``, an
output sized by values such as ``nonzero``) makes the host wait for the device, and the next
kernels launch late. On CPU nothing waits, so the same reads pass unseen; this guard makes them
fail on any device:

- a dispatch mode raises on the aten ops that read values on the host or size their output by
  them (``FORBIDDEN_OPS``; boolean-mask indexing is ``nonzero`` inside);
- ``Tensor.tolist`` / ``item`` / ``cpu`` / ``numpy`` / ``__int__`` / ``__float__`` /
  ``__bool__`` / ``__index__`` raise (``tolist`` and ``cpu()`` of a CPU tensor never reach the
  dispatcher);
- with CUDA, ``torch.cuda.set_sync_debug_mode("error")`` catches what the kernels themselves sync.

Only the thread that entered the guard is checked (thread ranks may share the process), and a
collective's own implementation is not (the thread ranks' process group reads its tensors).
"""

import threading
from contextlib import contextmanager
from typing import Iterator

import torch

from titan_lightning._compat import TorchDispatchMode

_aten = torch.ops.aten
FORBIDDEN_OPS = {
    _aten._local_scalar_dense.default: "a value read on the host (.item(), int(t), bool(t))",
    _aten.nonzero.default: "nonzero (its size depends on values; nonzero_static does not)",
    _aten.bincount.default: "bincount (reads the largest id on the host to size its output on CUDA)",
    _aten.masked_select.default: "masked_select (its size depends on values)",
    _aten.repeat_interleave.Tensor: "repeat_interleave with tensor repeats (its size depends on values)",
    _aten._unique2.default: "unique (its size depends on values)",
    _aten.unique_consecutive.default: "unique_consecutive (its size depends on values)",
    _aten.unique_dim.default: "unique (its size depends on values)",
    _aten.equal.default: "torch.equal (a bool on the host)",
}
_COLLECTIVES = ("_c10d_functional", "c10d", "_c10d_functional_autograd")
FORBIDDEN_METHODS = ("tolist", "item", "cpu", "numpy", "__int__", "__float__", "__bool__", "__index__")


class HostSyncError(RuntimeError):
    """Raised by ``forbid_host_sync`` at the call that would read a device value on the host."""


class _Forbid(TorchDispatchMode):
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        why = FORBIDDEN_OPS.get(func)
        if why is None and func in (_aten.index.Tensor, _aten.index_put.default, _aten.index_put_.default):
            if any(i is not None and i.dtype == torch.bool for i in args[1]):
                why = "indexing with a boolean mask (nonzero inside)"
        if why is None and func is _aten.repeat_interleave.self_Tensor and kwargs.get("output_size") is None:
            why = "repeat_interleave with tensor repeats and no output_size"
        if why is not None:
            raise HostSyncError(f"host synchronization on the token path: {func}: {why}")
        if func.namespace in _COLLECTIVES:  # the process group's own code (thread ranks read tensors)
            outer, _state.active = _state.active, False
            try:
                return func(*args, **kwargs)
            finally:
                _state.active = outer
        return func(*args, **kwargs)


_state = threading.local()
_lock = threading.Lock()
_installed = {"count": 0, "saved": {}}


def _raising(name: str):
    original = getattr(torch.Tensor, name)

    def method(self, *args, **kwargs):
        if getattr(_state, "active", False):
            raise HostSyncError(f"host synchronization on the token path: Tensor.{name}()")
        return original(self, *args, **kwargs)

    return method


def _install() -> None:
    with _lock:
        if _installed["count"] == 0:
            for name in FORBIDDEN_METHODS:
                _installed["saved"][name] = torch.Tensor.__dict__.get(name)
                setattr(torch.Tensor, name, _raising(name))
        _installed["count"] += 1


def _uninstall() -> None:
    with _lock:
        _installed["count"] -= 1
        if _installed["count"] == 0:
            for name, original in _installed["saved"].items():
                if original is None:
                    delattr(torch.Tensor, name)
                else:
                    setattr(torch.Tensor, name, original)
            _installed["saved"].clear()


@contextmanager
def forbid_host_sync() -> Iterator[None]:
    """Raise ``HostSyncError`` at any host read of a tensor value in this thread while active."""
    cuda = torch.cuda.is_available()
    previous = torch.cuda.get_sync_debug_mode() if cuda else None
    _install()
    outer, _state.active = getattr(_state, "active", False), True
    try:
        if cuda:
            torch.cuda.set_sync_debug_mode("error")
        with _Forbid():
            yield
    finally:
        _state.active = outer
        if cuda:
            torch.cuda.set_sync_debug_mode(previous)
        _uninstall()
