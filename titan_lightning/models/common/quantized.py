"""Quantized Hugging Face checkpoints, dequantized as they are read: the block-scaled FP8 of the
published DeepSeek V3 / R1 checkpoints (``fp8_dequantized``) and gpt-oss's MXFP4 experts
(``mxfp4_dequantized``, exactly as transformers' ``convert_moe_packed_tensors``). Each wraps the
``HFTensors`` of a folder (safetensors_io.py), so a rank reads only the blocks and scales of its
share; ``check_quantization`` reads config.json's ``quantization_config``.
"""

import math
from typing import Any

import torch
from torch import Tensor

from titan_lightning.models.common.hf_config import HFConfig
from titan_lightning.models.common.safetensors_io import HFTensors

# The FP8 quantization_config read (the published DeepSeek V3 / R1 checkpoints').
FP8_QUANTIZATION = {"quant_method": "fp8", "fmt": "e4m3", "weight_block_size": [128, 128],
                    "activation_scheme": "dynamic"}
FP8_BLOCK = tuple(FP8_QUANTIZATION["weight_block_size"])
SCALE_SUFFIX = "_scale_inv"
# FP4 e2m1 by its 4-bit code (transformers' FP4_VALUES).
FP4_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)
BLOCKS, SCALES = "_blocks", "_scales"
MXFP4_QUANTIZATION = {"quant_method": "mxfp4"}


def check_quantization(quantization: Any, config: HFConfig, expected: dict[str, Any],
                       ignored: tuple[str, ...] = ()) -> None:
    """config.json's ``quantization_config`` is the format read here: its fields hold the ``expected``
    values (``ignored`` ones change nothing); any other field refused by name."""
    fields = HFConfig(quantization if isinstance(quantization, dict) else {}, f"{config.source}: quantization_config",
                      config.family)
    fields.get("quant_method")
    for name, value in expected.items():
        fields.expect(name, value)
    fields.ignore(*ignored)
    fields.finish()


def fp8_dequantized(tensors: HFTensors, block: tuple[int, int] = FP8_BLOCK) -> HFTensors:
    """``tensors`` as the model reads them: each ``*.weight`` with a ``*.weight_scale_inv`` is its
    float8_e4m3fn values times the float32 scale of their ``block`` (edge blocks cropped), in
    float32; the scales are hidden. A block read reads only the scales over it. The scales' shapes
    are checked from the headers, dtypes on read; one-line errors name the Hugging Face key."""
    names = set(tensors.keys())
    scales = {}
    for name in tensors.keys():
        if not name.endswith(SCALE_SUFFIX):
            continue
        weight = name.removesuffix(SCALE_SUFFIX)
        if weight not in names:
            raise ValueError(f"{name}: a block scale without its weight {weight}")
        shape = tensors.shape(weight)
        if len(shape) != 2:
            raise ValueError(f"{name}: block scales for {weight} of shape {list(shape)}; they need a matrix")
        tiles = tuple(math.ceil(n / b) for n, b in zip(shape, block))
        if tensors.shape(name) != tiles:
            raise ValueError(f"{name} has shape {list(tensors.shape(name))}, expected {list(tiles)} (one scale per "
                             f"{block[0]}x{block[1]} block of the {list(shape)} weight)")
        scales[weight] = name

    def read(name: str, index: tuple[slice, ...]) -> Tensor:
        value = tensors.read(name, index)
        if name in scales:
            if value.dtype != torch.float8_e4m3fn:
                raise ValueError(f"{scales[name]}: a block scale, but {name} is {value.dtype}, not float8_e4m3fn")
            return value.float() * _scales_over(tensors, scales[name], tensors.shape(name), index, block)
        if value.dtype == torch.float8_e4m3fn:
            raise ValueError(f"{name} is float8_e4m3fn but {name}{SCALE_SUFFIX} is missing (one float32 scale "
                             f"per {block[0]}x{block[1]} block)")
        if value.dtype.is_floating_point and value.element_size() == 1:
            raise ValueError(f"{name} is {value.dtype}; only float8_e4m3fn weights with block scales are read")
        return value

    return HFTensors({name: tensors.shape(name) for name in tensors.keys() if not name.endswith(SCALE_SUFFIX)}, read)


def _scales_over(tensors: HFTensors, scale: str, shape: tuple[int, ...], index: tuple[slice, ...],
                 block: tuple[int, int]) -> Tensor:
    """The block scales ``scale`` spread over each element of the weight's block ``index``."""
    (r0, r1, _), (c0, c1, _) = (s.indices(n) for s, n in zip((*index, slice(None), slice(None)), shape))
    tiles = tensors.read(scale, (slice(r0 // block[0], math.ceil(r1 / block[0])),
                                 slice(c0 // block[1], math.ceil(c1 / block[1]))))
    spread = tiles.float().repeat_interleave(block[0], dim=0).repeat_interleave(block[1], dim=1)
    first_row, first_col = r0 % block[0], c0 % block[1]
    return spread[first_row:first_row + r1 - r0, first_col:first_col + c1 - c0]


def dequantize_mxfp4(blocks: Tensor, scales: Tensor) -> Tensor:
    """[..., G, 16] uint8 blocks (two FP4 e2m1 codes a byte, low nibble first) and [..., G] uint8
    E8M0 scales -> [..., G * 32] float32: each value times 2^(scale - 127)."""
    if blocks.dtype != torch.uint8 or scales.dtype != torch.uint8:
        raise ValueError(f"MXFP4 blocks and scales must be uint8, got {blocks.dtype} and {scales.dtype}")
    lut = torch.tensor(FP4_VALUES, dtype=torch.float32, device=blocks.device)
    values = torch.stack([lut[(blocks & 0x0F).long()], lut[(blocks >> 4).long()]], dim=-1).flatten(-2)
    return torch.ldexp(values, (scales.to(torch.int32) - 127)[..., None]).flatten(-2)


def mxfp4_dequantized(tensors: HFTensors) -> HFTensors:
    """``tensors`` with each ``NAME_blocks`` [E, rows, G, 16] + ``NAME_scales`` [E, rows, G] pair
    shown as ``NAME`` [E, G * 32, rows] float32 (transformers' layout of the dequantized weight);
    a read of experts a..b reads only their blocks. Shapes checked from the headers."""
    packed = {}
    for name in tensors.keys():
        if not name.endswith(BLOCKS):
            continue
        base = name.removesuffix(BLOCKS)
        shape, scale_shape = tensors.shape(name), tensors.shape(base + SCALES) if base + SCALES in tensors.keys() else None
        if len(shape) != 4 or shape[-1] != 16 or scale_shape != shape[:-1]:
            raise ValueError(f"{name} {list(shape)} with {base}{SCALES} {scale_shape and list(scale_shape)}: MXFP4 "
                             f"needs blocks [experts, rows, groups, 16] and scales [experts, rows, groups]")
        packed[base] = (shape[0], shape[2] * 32, shape[1])
    hidden = {p + s for p in packed for s in (BLOCKS, SCALES)}
    orphans = [n for n in tensors.keys() if n.endswith(SCALES) and n not in hidden]
    if orphans:
        raise ValueError(f"{orphans[0]}: MXFP4 scales without their {orphans[0].removesuffix(SCALES)}{BLOCKS}")

    def read(name: str, index: tuple[slice, ...]) -> Tensor:
        if name not in packed:
            return tensors.read(name, index)
        experts = index[:1]
        full = dequantize_mxfp4(tensors.read(name + BLOCKS, experts), tensors.read(name + SCALES, experts))
        return full.transpose(1, 2)[(slice(None), *index[1:])]

    shapes = {n: tensors.shape(n) for n in tensors.keys() if n not in hidden}
    return HFTensors({**shapes, **packed}, read)
