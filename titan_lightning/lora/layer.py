"""The LoRA layer and what a model with adapters needs: adding them, their init, a frozen base
in the compute dtype, and views of the model without them (its base) or with them switched off.

A target ``nn.Linear`` becomes a ``LoRALinear``: the same module (its ``weight`` and ``bias`` keep
their names, so a base checkpoint loads as it is) with two children, ``lora_a`` [rank, in] and
``lora_b`` [out, rank], PEFT's ``lora_A`` / ``lora_B``. Children, not extra parameters, so a
tensor-parallel style record can shard them with their base (parallel/tensor_styles.py: under
colwise A replicated and B colwise, under rowwise A rowwise and B replicated).
"""

import math
from contextlib import contextmanager
from typing import Iterator, Sequence, Union

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor

from titan_lightning.parallel.float8 import frozen_float8_linear
from titan_lightning.parallel.nf4 import holds_nf4, is_nf4, nf4_shard

ADAPTER_NAMES = ("lora_a", "lora_b")
NF4_BLOCK, NF4_SCALER_BLOCK = 64, 256  # torchao's (and QLoRA's) defaults
_CHILDREN = (*ADAPTER_NAMES, "lora_dropout")


class LoRALinear(nn.Linear):
    """``x W^T + b + lora_b(lora_a(dropout(x)) * alpha / rank)``; ``adapters_on`` False: the base alone."""

    def __init__(self, in_features: int, out_features: int, *, rank: int, alpha: float, dropout: float = 0.0,
                 bias: bool = False, device=None, dtype=None) -> None:
        super().__init__(in_features, out_features, bias=bias, device=device, dtype=dtype)
        self.lora_a = nn.Linear(in_features, rank, bias=False, device=device, dtype=dtype)
        self.lora_b = nn.Linear(rank, out_features, bias=False, device=device, dtype=dtype)
        self.lora_dropout = nn.Dropout(dropout) if dropout > 0 else nn.Identity()
        self.scaling = alpha / rank
        self.adapters_on = True
        self.float8 = None  # parallel/float8.py's Float8Base: the base matmul in float8 (quantize.float8)

    @classmethod
    def from_linear(cls, linear: nn.Linear, *, rank: int, alpha: float, dropout: float = 0.0) -> "LoRALinear":
        """``linear``'s own parameters (no copy) with new adapters on their device."""
        w = linear.weight
        lora = cls(linear.in_features, linear.out_features, rank=rank, alpha=alpha, dropout=dropout,
                   device="meta", dtype=w.dtype)
        lora.weight, lora.bias = w, linear.bias
        lora.lora_a.to_empty(device=w.device)
        lora.lora_b.to_empty(device=w.device)
        return lora

    def share_a(self, lora_a: nn.Linear) -> None:
        """Compute with another layer's A (the parts of a fused linear: ``add_adapters``), held as a
        plain attribute, not a child: the owner's module tree alone holds it (one parameter, one
        state-dict key, one shard, one visit of ``_apply``), and a layout that swaps its parameter
        (FSDP2's unsharded one, a TP style's DTensor) swaps it for this layer too."""
        del self._modules["lora_a"]
        self.__dict__["lora_a"] = lora_a

    def _apply(self, fn, recurse: bool = True):
        """An NF4 weight (QLoRA; or FSDP2's shard of one) stays as it is: ``to_empty`` would copy its
        quantization tables uninitialized, a cast would undo the quantization; the rest of the layer as usual."""
        if not holds_nf4(self.weight):
            return super()._apply(fn, recurse)
        weight = self._parameters.pop("weight")
        try:
            return super()._apply(fn, recurse)
        finally:
            self._parameters = {"weight": weight, **self._parameters}

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        base = self.base_forward(x)
        if not self.adapters_on:
            return base
        return self.add_adapter(base, self.lora_a(self.lora_dropout(x)))

    def base_forward(self, x: torch.Tensor) -> torch.Tensor:
        """The frozen base's output alone."""
        if is_nf4(self.weight):  # (QLoRA: dequantized for this forward, its backward to x alone)
            base = linear_nf4(x, self.weight)
            return base if self.bias is None else base + self.bias
        if self.float8 is not None:  # (its backward to x alone too)
            base = frozen_float8_linear(x, self.weight, self.float8)
            return base if self.bias is None else base + self.bias.to(base.dtype)
        return F.linear(x, self.weight, self.bias)

    def add_adapter(self, base: torch.Tensor, h: torch.Tensor) -> torch.Tensor:
        """``base`` plus the adapter's output from ``h``, A's output (the rank-wide activation)."""
        # The scaling on the rank-wide activation, not on the output: the backward then takes the
        # output's gradient as it is (no pass over it to scale it; a power of two, as alpha = 2 x rank,
        # gives the same bits either way).
        return base + self.lora_b(h * self.scaling)

    @staticmethod
    def together(x: torch.Tensor, linears: Sequence[nn.Module]) -> tuple[torch.Tensor, ...]:
        """Each of ``linears`` applied to the same ``x`` (``models.common.projection.project``: a
        block's q / k / v, its gate / up), the As of those that are ``LoRALinear``s computed as one
        GEMM of their concatenated weights (x read once, and once more for their gradients; one
        A of a fused linear's parts, ``share_a``, once). The bases, the Bs and the rest as each layer
        computes them. A layer whose call does more than its forward (a hook: a tensor-parallel
        style's, FSDP2 on the layer itself), whose A is a DTensor or draws dropout keeps its own call.
        Compiled graphs only (a GEMM launch is what it saves; an eager run computes op for op as
        PEFT does, its exactness reference; the joint GEMM rounds differently in the last bits)."""
        if not torch.compiler.is_compiling():  # (eager: no per-call checks on this path)
            return tuple(layer(x) for layer in linears)
        joint = [_joinable(layer) for layer in linears]
        if sum(joint) < 2 or _global_hooks():
            return tuple(layer(x) for layer in linears)
        heads: list[nn.Linear] = []  # the distinct As, in order
        for layer, j in zip(linears, joint):
            if j and not any(a is layer.lora_a for a in heads):
                heads.append(layer.lora_a)
        weights = [a.weight for a in heads]
        h = F.linear(x, torch.cat(weights) if len(weights) > 1 else weights[0])
        parts = h.split([w.shape[0] for w in weights], dim=-1)
        out = []
        for layer, j in zip(linears, joint):
            if j:
                part = next(p for a, p in zip(heads, parts) if a is layer.lora_a)
                out.append(layer.add_adapter(layer.base_forward(x), part))
            else:
                out.append(layer(x))
        return tuple(out)

    def extra_repr(self) -> str:
        float8 = ", float8 base" if self.float8 is not None else ""
        return f"{super().extra_repr()}, rank={self.lora_a.out_features}, scaling={self.scaling:g}{float8}"


def _hooked(module: nn.Module) -> bool:
    return bool(module._forward_hooks or module._forward_pre_hooks or module._backward_hooks
                or module._backward_pre_hooks)


def _joinable(layer: nn.Module) -> bool:
    """Whether ``LoRALinear.together`` may compute ``layer``'s A jointly (its forward alone, exactly)."""
    return (isinstance(layer, LoRALinear) and layer.adapters_on and isinstance(layer.lora_dropout, nn.Identity)
            and not isinstance(layer.lora_a.weight, DTensor) and not _hooked(layer) and not _hooked(layer.lora_a))


def _global_hooks() -> bool:
    """Hooks registered for every module's call (``nn.modules.module.register_module_forward_hook``...)."""
    from torch.nn.modules import module  # (its private registries of global hooks)

    return bool(module._global_forward_hooks or module._global_forward_pre_hooks or module._global_backward_hooks
                or module._global_backward_pre_hooks)


def linear_nf4(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """``x @ dequantize(weight).T``, keeping the NF4 weight alone for the backward. Eager, torchao's
    function does so; compiled, the partitioner would keep the dequantized weight for the backward
    (the forward's and the backward's dequantizations are one node once traced together: 13 GiB of
    bf16 weights for an 8B model, more than the NF4 base saves). A checkpoint around it whose policy
    says every op must be recomputed makes the dequantization one the backward redoes (the matmul's
    output is not needed there). (A plain checkpoint only prefers recomputing: torch 2.13's partitioner
    then recomputed it, torch 2.11's kept the dequantized weights, 37.3 GiB on an H200, run 9.)"""
    from torchao.dtypes.nf4tensor import linear_nf4 as nf4  # (torchao: only a QLoRA run imports it)

    if torch.compiler.is_compiling():
        return torch.utils.checkpoint.checkpoint(nf4, x, weight, use_reentrant=False, context_fn=_recompute_all)
    return nf4(x, weight)


def _recompute_all():
    """A selective checkpoint's contexts that recompute every op of the region in the backward."""
    from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

    return create_selective_checkpoint_contexts(lambda ctx, op, *args, **kwargs: CheckpointPolicy.MUST_RECOMPUTE)


@torch.no_grad()
def quantize_base_nf4(model: nn.Module, device: torch.device) -> None:
    """QLoRA: every adapted layer's frozen weight becomes torchao's NF4 (4-bit NormalFloat, a scale per
    64 weights, a scale of scales per 256) on ``device``, one layer's dense weight at a time (a base
    larger than the device in bf16 never exists whole). Run when the model is built (on the meta
    device: FSDP2 then shards the NF4 weights, parallel/nf4.py) and again before it is
    materialized: ``to_empty`` leaves NF4 be, and the init and a load quantize what they copy into it.
    A weight FSDP2 sharded keeps its rows of the whole NF4 tensor."""
    from torchao.dtypes.nf4tensor import to_nf4

    for name, layer in lora_layers(model):
        w = layer.weight
        if w.numel() % NF4_BLOCK:
            raise ValueError(f"lora.quantize_base='nf4': {name}.weight has {w.numel()} values, not a multiple of "
                             f"NF4's block of {NF4_BLOCK}; set lora.quantize_base=None")
        if hasattr(w, "device_mesh") and not holds_nf4(w):
            raise ValueError(f"lora.quantize_base='nf4': {name}.weight was sharded dense (tensor parallel); an NF4 "
                             f"base shards under FSDP2 alone: set parallelism.tp=1 or lora.quantize_base=None")
        local = getattr(w, "_local_tensor", w)
        scaler_block = local.scaler_block_size if is_nf4(local) else nf4_scaler_block(w.numel())
        dense = torch.ones(w.shape, dtype=w.dtype, device=device)  # (the values come with the init or a load)
        nf4 = to_nf4(dense, NF4_BLOCK, scaler_block)
        layer.weight = nn.Parameter(nf4_shard(nf4, w) if hasattr(w, "device_mesh") else nf4, requires_grad=False)


def nf4_scaler_block(numel: int) -> int:
    """The scales of how many 64-weight blocks are quantized together in an NF4 weight of ``numel``
    values: NF4_SCALER_BLOCK, fewer in a small layer (one that holds fewer blocks)."""
    return math.gcd(NF4_SCALER_BLOCK, numel // NF4_BLOCK)


def lora_layers(model: nn.Module) -> Iterator[tuple[str, LoRALinear]]:
    return ((name, m) for name, m in model.named_modules() if isinstance(m, LoRALinear))


def adapted_modules(model: nn.Module) -> list[nn.Module]:
    """Every module with adapters: the LoRALinears and the routed experts' (lora/experts.py)."""
    return [m for m in model.modules() if hasattr(m, "adapters_on")]


def has_adapters(model: nn.Module) -> bool:
    return bool(adapted_modules(model))


class _InitWithAdapters:
    """A decoder's init law (``Decoder.init_param``) and the adapters': A as PEFT draws it
    (``kaiming_uniform_(a=sqrt(5))``, ``init_lora_weights=True``), B zero, so step 1 computes the
    base model; each from (seed, name) like every other parameter (models/common/init.py)."""

    def __init__(self, model: nn.Module) -> None:
        self.model = model

    def __call__(self, fqn: str, w: torch.Tensor, g: torch.Generator) -> None:
        if fqn.endswith(".lora_a.weight"):
            nn.init.kaiming_uniform_(w, a=math.sqrt(5), generator=g)
        elif fqn.endswith(".lora_b.weight"):
            nn.init.zeros_(w)
        else:
            type(self.model).init_param(self.model, fqn, w, g)


def add_adapters(model: nn.Module, targets: Union[list[str], dict[str, str]], *, rank: int, alpha: float,
                 dropout: float = 0.0) -> None:
    """Swap the linears named ``targets`` (module names within ``model``) for ``LoRALinear``s and
    freeze every other parameter: only the adapters train. ``targets`` as a dict: each linear's
    group (its Hugging Face module); the linears of one group (the parts of a fused tensor: Phi-3's
    q, k and v of ``qkv_proj``) share one ``lora_a`` module, so their A is PEFT's one A of the fused
    linear (its gradient the sum of theirs) and their Bs are the row blocks of PEFT's B: the first part
    holds it, the others compute with it (``LoRALinear.share_a``). (Each part draws its own dropout mask
    on the shared input, where PEFT draws one.)"""
    groups = targets if isinstance(targets, dict) else {name: name for name in targets}
    shared: dict[str, nn.Module] = {}
    for name, group in groups.items():
        parent, _, child = name.rpartition(".")
        owner = model.get_submodule(parent)
        lora = LoRALinear.from_linear(getattr(owner, child), rank=rank, alpha=alpha, dropout=dropout)
        if group in shared:
            if shared[group].in_features != lora.in_features:
                raise ValueError(f"{name} ({lora.in_features} input features) shares the adapter of {group} with "
                                 f"linears of {shared[group].in_features}")
            lora.share_a(shared[group])
        shared.setdefault(group, lora.lora_a)
        setattr(owner, child, lora)
    adapters = {id(p) for _, layer in lora_layers(model) for p in (layer.lora_a.weight, layer.lora_b.weight)}
    for param in model.parameters():
        param.requires_grad_(id(param) in adapters)
    if hasattr(model, "init_param"):  # (a Decoder: init_weights draws every parameter by its name)
        model.init_param = _InitWithAdapters(model)


def store_frozen_in(model: nn.Module, dtype: torch.dtype) -> None:
    """The frozen floating-point parameters in ``dtype`` (the compute dtype: no fp32 master copy of
    a base that never steps); trainable ones and buffers keep theirs. Before materializing: under
    FSDP2 only trainable parameters must share a dtype (its reduce-scatter), the all-gather casts
    all of them to the compute dtype."""
    model._apply(lambda t: t.to(dtype) if isinstance(t, nn.Parameter) and not t.requires_grad
                 and t.is_floating_point() else t)


@contextmanager
def base_only(model: nn.Module) -> Iterator[nn.Module]:
    """``model`` as its base checkpoint holds it: the adapters detached from their layers (a state
    dict, a load, an init see the base's names alone); put back on exit."""
    detached = [(layer, {name: layer._modules.pop(name) for name in _CHILDREN if name in layer._modules})
                for layer in adapted_modules(model)]
    try:
        yield model
    finally:
        for layer, children in detached:
            layer._modules.update(children)


@contextmanager
def adapters_off(model: nn.Module) -> Iterator[nn.Module]:
    """``model`` computing its base alone (a preference run's reference model, ``reference: adapters_off``)."""
    layers = adapted_modules(model)
    for layer in layers:
        layer.adapters_on = False
    try:
        yield model
    finally:
        for layer in layers:
            layer.adapters_on = True


@torch.no_grad()
def merged_weight(layer: LoRALinear) -> torch.Tensor:
    """``W + scaling * B A`` (full tensors: a DTensor's are gathered), in W's dtype, computed in fp32."""
    def full(t: torch.Tensor) -> torch.Tensor:
        return t.full_tensor() if hasattr(t, "full_tensor") else t

    w = full(layer.weight)
    w = w.get_original_weight() if is_nf4(w) else w
    delta = full(layer.lora_b.weight).float() @ full(layer.lora_a.weight).float()
    return (w.float() + delta * layer.scaling).to(w.dtype)
