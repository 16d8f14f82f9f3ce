"""Bitwise fingerprints of a model's weights and gradients, for "did these two runs agree?".

``hash_model`` covers parameters then buffers, ``hash_gradient`` the parameters' gradients,
each in ``named_parameters()`` / ``named_buffers()`` order. Every tensor contributes its
name, dtype, shape and raw bytes; a DTensor contributes its local shard plus its placements
and global shape, so two layouts of one tensor differ while reruns of one layout agree.

Under torch.distributed only rank 0 (of the default group) hashes; the other ranks return
``""``. Nothing here is a collective, so a hash can never hang a run.
"""

import hashlib
import json
from typing import Iterable, Optional

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

# (name, tensor); tensor None for a parameter without a gradient.
_Entry = tuple[str, Optional[torch.Tensor]]


def hash_model(model: torch.nn.Module, per_tensor: bool = False) -> str:
    """SHA-256 of all parameters and buffers; ``per_tensor=True`` gives JSON {name: sha256}."""
    if not _is_hashing_rank():
        return ""
    entries = [*model.named_parameters(), *model.named_buffers()]
    return _digest(entries, per_tensor)


def hash_gradient(model: torch.nn.Module, per_tensor: bool = False) -> str:
    """SHA-256 of all gradients (a parameter without one is recorded as such);
    ``per_tensor=True`` gives JSON {name: sha256}."""
    if not _is_hashing_rank():
        return ""
    entries = [(name, param.grad) for name, param in model.named_parameters()]
    return _digest(entries, per_tensor)


def first_difference(a_json: str, b_json: str) -> Optional[str]:
    """The first name, in ``a_json``'s order then ``b_json``'s, whose hash differs or that
    only one side has; None when the two per-tensor hashes agree."""
    a, b = _per_tensor_map(a_json, "a_json"), _per_tensor_map(b_json, "b_json")
    for name in [*a, *(name for name in b if name not in a)]:
        if a.get(name) != b.get(name):
            return name
    return None


def _is_hashing_rank() -> bool:
    return not (dist.is_available() and dist.is_initialized()) or dist.get_rank() == 0


def _digest(entries: Iterable[_Entry], per_tensor: bool) -> str:
    if per_tensor:
        hashes = {}
        for name, tensor in entries:
            one = hashlib.sha256()
            _feed(one, name, tensor)
            hashes[name] = one.hexdigest()
        return json.dumps(hashes, sort_keys=True)
    whole = hashlib.sha256()
    for name, tensor in entries:
        _feed(whole, name, tensor)
    return whole.hexdigest()


def _feed(h, name: str, tensor: Optional[torch.Tensor]) -> None:
    if tensor is None:
        h.update(f"{name}\0none\n".encode())
        return
    header, local = _describe(name, tensor)
    h.update(header.encode())
    h.update(_raw_bytes(name, local))


def _describe(name: str, tensor: torch.Tensor) -> tuple[str, torch.Tensor]:
    """The text fed before the bytes, and the tensor whose bytes are fed."""
    if isinstance(tensor, DTensor):
        local = tensor.to_local()
        layout = f"\0placements={tensor.placements}\0global_shape={tuple(tensor.shape)}"
    else:
        local, layout = tensor, ""
    return f"{name}\0{local.dtype}\0{tuple(local.shape)}{layout}\n", local


def _raw_bytes(name: str, tensor: torch.Tensor) -> bytes:
    if tensor.is_meta:
        raise ValueError(f"cannot hash {name!r}: it is on the meta device (materialize the model first)")
    flat = tensor.detach().to("cpu").contiguous().reshape(-1)  # reshape: view(dtype) refuses 0-dim
    return flat.view(torch.uint8).numpy().tobytes()  # bytes, not numpy: numpy has no bf16


def _per_tensor_map(text: str, argument: str) -> dict[str, str]:
    if not text:
        raise ValueError(f"{argument} is empty: per-tensor hashes exist on rank 0 only")
    hashes = json.loads(text)
    if not isinstance(hashes, dict):
        raise ValueError(f"{argument} must be the JSON of hash_*(..., per_tensor=True), got {text[:80]!r}")
    return hashes
