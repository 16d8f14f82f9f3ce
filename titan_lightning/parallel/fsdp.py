"""Data parallelism: FSDP2 / HSDP (``fully_shard``) and DDP (composable ``replicate``).

FSDP units, in forward order: the token embeddings, each transformer block, the final
norm with the output head, then the root (whatever is left). A model that is not a Llama
passes its blocks; ``find_repeated_blocks`` finds them in a model that knows nothing of us.
Apply FSDP after TP, activation checkpointing and compile.
"""

from typing import Any, Optional

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed._composable.replicate import replicate
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard

from titan_lightning.config.parallelism import FSDP_RESHARD_POLICIES
from titan_lightning.parallel.contracts import grouped_experts
from titan_lightning.parallel.nf4 import check_even_split


def apply_fsdp(
    model: nn.Module,
    mesh: DeviceMesh,
    *,
    param_dtype: torch.dtype,
    reduce_dtype: torch.dtype,
    reshard_after_forward: str = "default",
    cpu_offload: bool = False,
    blocks: Optional[list[nn.Module]] = None,
    expert_mesh: Optional[DeviceMesh] = None,
) -> nn.Module:
    """Shard ``model`` over ``mesh``: 1-D (dp_shard_cp) for FSDP, 2-D (dp_replicate, dp_shard_cp) for HSDP.

    ``reshard_after_forward``: "default" frees every unit's gathered weights after its
    forward except the last unit's (the head, or the last block), whose backward comes
    right away; "always" frees all of them; "never" keeps all of them until backward.
    ``blocks`` defaults to ``model.layers`` when the model has one, else to
    ``find_repeated_blocks(model)``. ``expert_mesh`` (under expert parallelism): the routed
    experts are sharded over it first, each MoE layer's experts as their own unit, so the
    dense units around them leave their (ep-sharded) weights alone.
    """
    if reshard_after_forward not in FSDP_RESHARD_POLICIES:
        raise ValueError(
            f"parallelism.fsdp_reshard_after_forward={reshard_after_forward!r} is not one of "
            f"{', '.join(FSDP_RESHARD_POLICIES)}"
        )
    if mesh.ndim not in (1, 2):
        raise ValueError(
            f"FSDP mesh has {mesh.ndim} dims {mesh.mesh_dim_names}; pass 1 (dp_shard_cp) "
            f"or 2 (dp_replicate, dp_shard_cp) for HSDP"
        )
    check_even_split(model, mesh.shape[-1])  # (QLoRA's NF4 base: whole scale blocks on every rank)
    config = {"mesh": mesh, "mp_policy": MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=reduce_dtype)}
    if cpu_offload:
        config["offload_policy"] = CPUOffloadPolicy()

    if expert_mesh is not None:
        expert_config = {**config, "mesh": expert_mesh}
        for experts in grouped_experts(model):
            fully_shard(experts, **expert_config, reshard_after_forward=reshard_after_forward != "never")
            # An expert's gradient already sums the tokens of every rank that routed to it, so it
            # must be averaged over the dense data-parallel ranks (mesh), while FSDP divides by the
            # expert FSDP ranks: scale the rest in autograd (a custom divide factor would need
            # PREMUL_SUM, which gloo lacks).
            experts.grad_scale = expert_mesh.size() / mesh.size()
    units = _fsdp_units(model, model_blocks(model) if blocks is None else blocks)
    for i, unit in enumerate(units):
        last = i == len(units) - 1
        reshard = {"always": True, "never": False, "default": not last}[reshard_after_forward]
        fully_shard(unit, **config, reshard_after_forward=reshard)
    fully_shard(model, **config, reshard_after_forward=reshard_after_forward != "never")
    return model


def _fsdp_units(model: nn.Module, blocks: list[nn.Module]) -> list:
    """The modules (or module groups) to shard on their own, in forward order."""
    embeddings = getattr(model, "tok_embeddings", None)
    head = [m for m in (getattr(model, "norm", None), getattr(model, "output", None)) if m is not None]
    units = [embeddings] if embeddings is not None else []
    units.extend(blocks)
    if head:
        units.append(head)
    return units


def model_blocks(model: nn.Module) -> list[nn.Module]:
    """The transformer blocks: ``model.layers`` when it has one, else the repeated blocks."""
    layers = getattr(model, "layers", None)
    if isinstance(layers, nn.ModuleDict):
        return list(layers.values())
    if isinstance(layers, nn.ModuleList):
        return list(layers)
    return find_repeated_blocks(model)


def apply_ddp(model: nn.Module, dp_replicate_mesh: DeviceMesh) -> nn.Module:
    """Replicate ``model`` over the 1-D ``dp_replicate_mesh`` and all-reduce (average) its gradients.

    For DDP alone: the mesh must span the world (DDP does not compose with TP or FSDP here;
    HSDP is ``apply_fsdp`` with a 2-D mesh). Parameters stay plain tensors. The wrapper
    starts on the first forward, so a model may be replicated on the meta device and
    materialized afterwards.
    """
    if dp_replicate_mesh.ndim != 1:
        raise ValueError(
            f"DDP mesh has {dp_replicate_mesh.ndim} dims {dp_replicate_mesh.mesh_dim_names}; "
            f"pass the 1-D dp_replicate mesh"
        )
    world = dist.get_world_size()
    if dp_replicate_mesh.size() != world:
        raise ValueError(
            f"DDP over parallelism.dp_replicate={dp_replicate_mesh.size()} ranks of a world of {world}: "
            f"DDP does not compose with other parallelisms; use dp_shard (FSDP/HSDP) with them"
        )
    replicate(model, device_mesh=dp_replicate_mesh, bucket_cap_mb=100)
    return model


def find_repeated_blocks(module: nn.Module) -> list[nn.Module]:
    """The children of the largest ModuleList/ModuleDict made of >= 2 modules of one class.

    Largest means the most parameter elements (works on the meta device); modules without
    parameters are not candidates. Empty when there is none.
    """
    best: list[nn.Module] = []
    best_size = 0
    for container in module.modules():
        if not isinstance(container, (nn.ModuleList, nn.ModuleDict)):
            continue
        children = list(container.children())
        if len(children) < 2 or len({type(c) for c in children}) != 1:
            continue
        size = sum(p.numel() for p in container.parameters())
        if size > best_size:
            best, best_size = children, size
    return best


class OutsideCalls:
    """Calls into an FSDP root's submodules from outside the root's forward, made to work.

    The root's own parameters (those no inner FSDP unit holds: an embedding, a head, parameters of
    the root itself) are gathered by the root's forward hooks. A submodule called directly, not
    through the root's forward (``module.model(x)`` in a Lightning hook or callback, or after
    ``trainer.fit`` in the user's script, while the root is the LightningModule), would meet them
    sharded ("mixed torch.Tensor and DTensor"). So each *entry module* (a submodule outside every
    inner unit that holds root parameters) runs, when called with no root forward in flight, inside
    the root's own forward hooks: the pre-hooks before its own, the post-hooks after it. That is
    exactly what a root forward around the call does: parameters gathered (and cast under mixed
    precision), gradients reduce-scattered after a backward through the output. When no backward can
    follow (grad mode off, or an output that needs no gradient), every unit reshards right after,
    as also after a root forward of its own under ``torch.no_grad()`` (FSDP keeps the root and the
    last unit gathered for the backward otherwise): nothing stays gathered for the next step.
    """

    def __init__(self, root: nn.Module) -> None:
        from torch.distributed.fsdp import FSDPModule

        self.root = root
        self.depth = 0  # root forwards in flight (its own, or one opened around an entry module)
        self._opener: Optional[nn.Module] = None
        self._fsdp_modules = [m for m in root.modules() if isinstance(m, FSDPModule)]
        units = {id(m) for m in self._fsdp_modules if m is not root}
        self.entries: list[nn.Module] = []

        def holds_root_parameters(module: nn.Module) -> bool:
            holds = next(module.parameters(recurse=False), None) is not None
            for child in module.children():
                if id(child) not in units:
                    holds = holds_root_parameters(child) or holds
            if holds and module is not root:
                self.entries.append(module)
            return holds

        holds_root_parameters(root)
        self._handles = [root.register_forward_pre_hook(self._root_enter, prepend=True),
                         root.register_forward_hook(self._root_leave, always_call=True)]
        for module in self.entries:
            self._handles += [module.register_forward_pre_hook(self._open, prepend=True, with_kwargs=True),
                              module.register_forward_hook(self._close, with_kwargs=True, always_call=True)]

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []

    def _root_enter(self, module: nn.Module, args: Any) -> None:
        self.depth += 1

    def _root_leave(self, module: nn.Module, args: Any, output: Any) -> None:
        self.depth -= 1
        if self.depth == 0 and not _needs_backward(output):
            self.reshard()

    def reshard(self) -> None:
        """Every unit sharded again (the root, and a last unit FSDP keeps gathered for a backward)."""
        for module in self._fsdp_modules:
            module.reshard()

    def _open(self, module: nn.Module, args: tuple, kwargs: dict) -> Optional[tuple]:
        if self.depth > 0:
            return None
        self._opener = module
        root, hooks = self.root, self.root._forward_pre_hooks
        for key, hook in list(hooks.items()):
            if key in root._forward_pre_hooks_with_kwargs:
                result = hook(root, args, kwargs)
                if result is not None:
                    args, kwargs = result
            else:
                result = hook(root, args)
                if result is not None:
                    args = result if isinstance(result, tuple) else (result,)
        return args, kwargs

    def _close(self, module: nn.Module, args: tuple, kwargs: dict, output: Any) -> Any:
        if self._opener is not module:
            return None
        self._opener = None
        root = self.root
        try:
            for key, hook in list(root._forward_hooks.items()):
                if key in root._forward_hooks_with_kwargs:
                    result = hook(root, args, kwargs, output)
                else:
                    result = hook(root, args, output)
                if result is not None:
                    output = result
        finally:
            if self.depth:  # (the forward raised before the root's hooks could close)
                self.depth = 0
                self.reshard()
        return output


def _needs_backward(output: Any) -> bool:
    """Whether a backward can still come through ``output`` (grad mode on and a tensor needing it)."""
    if not torch.is_grad_enabled():
        return False
    from torch.utils._pytree import tree_leaves

    return any(isinstance(leaf, torch.Tensor) and leaf.requires_grad for leaf in tree_leaves(output))
