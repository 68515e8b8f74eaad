"""KT's loaders for experts stored quantized (what SGLang's KT fork calls to serve expert LoRA
on a quantized model), each loaded into the SFT layer as stored, without quantizing again:

- RAWINT4 (compressed-tensors int4): signed int4 in groups of 32 along K with one scale per
  group, as "pack-quantized" stores it (offset-8 nibbles, the even column in the low nibble,
  int32 words or their bytes), for ``RAWINT4_SFT`` (``SFTMoEWrapper.load_rawint4_weights``);
- block FP8 (DeepSeek-V3 style): e4m3 matrices with one ``weight_scale_inv`` per 128×128
  block, for ``AMXFP8_SFT`` (``SFTMoEWrapper.load_block_fp8_weights``);
- MXFP4: e2m1 nibbles with a power-of-two scale per 32 columns, for
  ``MXFP4_SFT`` (``SFTMoEWrapper.load_mxfp4_weights``; its runtime: ``get_mxfp4_runtime``).

``MOEArchConfig`` and the dataclasses need nothing; the checkpoint readers return torch tensors
(torch and safetensors).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any, Mapping

from ..errors import KTFileNotFoundError, KTValueError

RAWINT4_GROUP_SIZE = 32
RAWINT4_WEIGHT_LAYOUT = "int4-g32: offset-8 nibbles (even column low), one scale per 32 columns"
FP8_WEIGHT_LAYOUT = "fp8: e4m3 bytes, one f32 scale per 128x128 block"
MXFP4_WEIGHT_LAYOUT = "mxfp4: e2m1 nibbles (even column low), one power-of-two scale per 32 columns"


@dataclass
class MOEArchConfig:
    """Where a model keeps its MoE experts (KT's ``kt_kernel.sft.MOEArchConfig``)."""

    moe_layer_attr: str
    router_attr: str
    experts_attr: str
    weight_names: tuple
    expert_num: int
    intermediate_size: int
    num_experts_per_tok: int
    has_shared_experts: bool = False
    router_type: str = "linear"


@dataclass
class RAWINT4ExpertWeights:
    """One layer's experts: packed ``[E, rows, cols/2]`` uint8 and ``[E, rows, cols/32]`` scales
    for gate, up (rows I, cols H) and down (rows H, cols I)."""

    gate_proj: Any
    gate_scale: Any
    up_proj: Any
    up_scale: Any
    down_proj: Any
    down_scale: Any
    group_size: int = RAWINT4_GROUP_SIZE


@dataclass
class BlockFP8ExpertWeights:
    """One layer's experts, unstacked: per projection ``E`` e4m3 matrices (gate, up ``[I, H]``,
    down ``[H, I]``) and ``E`` f32 scales, one per 128×128 block."""

    gate_proj: list
    gate_scale: list
    up_proj: list
    up_scale: list
    down_proj: list
    down_scale: list
    block_size: tuple = (128, 128)


@dataclass(frozen=True)
class Runtime:
    """What a ``get_*_runtime`` probe describes: the CPU variant, its kernel and the weight layout."""

    cpu_variant: str
    kernel: str
    weight_layout: str


# KT's names for what its probes return.
RAWINT4Runtime = FP8Runtime = MXFP4Runtime = Runtime


@dataclass(frozen=True)
class RAWINT4CheckpointContract:
    bits: int = 4
    group_size: int = RAWINT4_GROUP_SIZE
    signed: bool = True
    symmetric: bool = True
    zero_point: bool = False
    format: str = "pack-quantized"


def _runtime(kernel: str, layout: str) -> Runtime:
    """The runtime of a stored format: every backend of this build runs it with its own kernels
    (``kernel`` names them), so it is always there."""
    import kt_kernel

    return Runtime(kt_kernel.__cpu_variant__, f"{kt_kernel.__cpu_variant__}-{kernel}", layout)


def get_rawint4_runtime() -> Runtime:
    """The RAWINT4 SFT runtime (int4 groups of 32)."""
    return _runtime("int4-g32", RAWINT4_WEIGHT_LAYOUT)


def get_fp8_runtime() -> Runtime:
    """The block-FP8 SFT runtime (e4m3, 128×128 blocks)."""
    return _runtime("fp8", FP8_WEIGHT_LAYOUT)


def get_mxfp4_runtime() -> Runtime:
    """The MXFP4 SFT runtime (e2m1, blocks of 32)."""
    return _runtime("mxfp4-g32", MXFP4_WEIGHT_LAYOUT)


def _get(config, name, default=None):
    return config.get(name, default) if isinstance(config, Mapping) else getattr(config, name, default)


def get_rawint4_checkpoint_contract(model_config: Any) -> RAWINT4CheckpointContract:
    """Check that a model config (``config.json`` as a dict, or an object) describes weights
    ``RAWINT4_SFT`` loads as they are: compressed-tensors, pack-quantized, compressed, weight-only
    symmetric int4 in static groups of 32 with no zero points. Raises ValueError naming the field
    that differs."""
    quant = _get(model_config, "quantization_config")
    if quant is None and _get(model_config, "text_config") is not None:
        quant = _get(_get(model_config, "text_config"), "quantization_config")
    if quant is None:
        raise KTValueError("RAWINT4 SFT needs the model's quantization_config (compressed-tensors int4)")
    norm = lambda v: str(v or "").lower().replace("_", "-")
    for field, want in [("quant_method", "compressed-tensors"), ("format", "pack-quantized"),
                        ("quantization_status", "compressed")]:
        if norm(_get(quant, field)) != want:
            raise KTValueError(f"RAWINT4 SFT needs quantization_config.{field} = {want!r}, got {_get(quant, field)!r}")
    groups = _get(quant, "config_groups")
    if not isinstance(groups, Mapping) or not groups:
        raise KTValueError("RAWINT4 SFT needs a non-empty quantization_config.config_groups")
    scheme = {"type": "int", "num_bits": 4, "strategy": "group", "group_size": RAWINT4_GROUP_SIZE, "dynamic": False,
            "symmetric": True, "actorder": None, "block_structure": None}
    schemes = 0
    for name, group in groups.items():
        if _get(group, "input_activations") is not None or _get(group, "output_activations") is not None:
            raise KTValueError(f"RAWINT4 SFT needs weight-only quantization; config group {name!r} quantizes activations")
        weights = _get(group, "weights")
        if weights is None:
            continue
        schemes += 1
        found = {k: _get(weights, k) for k in scheme}
        if found != scheme:
            raise KTValueError(f"RAWINT4 SFT config group {name!r}: weight scheme {found}, expected {scheme}")
        if (weights.get("zero_point") if isinstance(weights, Mapping) else _get(weights, "zero_point")) is not None:
            raise KTValueError(f"RAWINT4 SFT config group {name!r} declares zero points (symmetric weights only)")
    if not schemes:
        raise KTValueError("RAWINT4 SFT: quantization_config has no weight scheme")
    return RAWINT4CheckpointContract()


def load_rawint4_experts_from_checkpoint_files(checkpoint_files: Any, sharded_metadata: Any, layers_prefix: str,
                                               moe_config: MOEArchConfig, layer_idx: int, hidden_size: int,
                                               group_size: int = RAWINT4_GROUP_SIZE) -> RAWINT4ExpertWeights:
    """Layer ``layer_idx``'s experts from compressed-tensors safetensors files, as stored:
    ``{layers_prefix}.{layer_idx}.{moe_layer_attr}.{experts_attr}.{e}.{name}.weight_packed``
    (int32 ``[rows, cols/8]`` or uint8 ``[rows, cols/2]``), ``.weight_scale`` (bf16 or f32
    ``[rows, cols/32]``) and ``.weight_shape``; torch tensors stacked per projection. A missing
    tensor, a zero point or a shape that differs raises naming the tensor."""
    import torch

    if int(group_size) != RAWINT4_GROUP_SIZE:
        raise KTValueError(f"RAWINT4 SFT needs group_size {RAWINT4_GROUP_SIZE}, got {group_size}")
    if not checkpoint_files:
        raise KTFileNotFoundError("checkpoint_files is empty")
    h, i = int(hidden_size), int(moe_config.intermediate_size)
    if h % group_size or i % group_size:
        raise KTValueError(f"hidden_size {h} and intermediate_size {i} must be multiples of the group size {group_size}")
    where = _tensor_files(checkpoint_files, sharded_metadata)
    prefix = f"{layers_prefix}.{layer_idx}.{moe_config.moe_layer_attr}.{moe_config.experts_attr}"
    stacked = []
    for name, rows, cols in zip(moe_config.weight_names, (i, i, h), (h, h, i)):
        stems = [f"{prefix}.{e}.{name}" for e in range(int(moe_config.expert_num))]
        for s in stems:
            for zp in (f"{s}.weight_zero_point", f"{s}.zero_point"):
                if zp in where:
                    raise KTValueError(f"RAWINT4 SFT takes symmetric weights; the checkpoint has {zp}")
        t = _read(where, [f"{s}.{x}" for s in stems for x in ("weight_packed", "weight_scale", "weight_shape")], layer_idx)
        packed, scales = [], []
        for s in stems:
            shape = tuple(int(v) for v in t[f"{s}.weight_shape"].reshape(-1).tolist())
            if shape != (rows, cols):
                raise KTValueError(f"{s}.weight_shape is {shape}, expected {(rows, cols)}")
            p = t[f"{s}.weight_packed"]
            if p.dtype == torch.int32 and tuple(p.shape) == (rows, cols // 8):
                p = p.contiguous().view(torch.uint8).view(rows, cols // 2)
            elif p.dtype != torch.uint8 or tuple(p.shape) != (rows, cols // 2):
                raise KTValueError(f"{s}.weight_packed is {p.dtype} {tuple(p.shape)}, expected int32 "
                                 f"{(rows, cols // 8)} or uint8 {(rows, cols // 2)}")
            sc = t[f"{s}.weight_scale"]
            if sc.dtype not in (torch.bfloat16, torch.float32) or tuple(sc.shape) != (rows, cols // group_size):
                raise KTValueError(f"{s}.weight_scale is {sc.dtype} {tuple(sc.shape)}, expected bf16 or f32 "
                                 f"{(rows, cols // group_size)}")
            packed.append(p.contiguous())
            scales.append(sc.to(torch.bfloat16).contiguous())
        stacked += [torch.stack(packed).contiguous(), torch.stack(scales).contiguous()]
    g, gs, u, us, d, ds = stacked
    return RAWINT4ExpertWeights(g, gs, u, us, d, ds, group_size=int(group_size))


def load_block_fp8_experts_from_checkpoint_files(checkpoint_files: Any, sharded_metadata: Any, layers_prefix: str,
                                                 moe_config: MOEArchConfig, layer_idx: int, hidden_size: int,
                                                 block_size: tuple[int, int] = (128, 128)) -> BlockFP8ExpertWeights:
    """Layer ``layer_idx``'s experts from an FP8 checkpoint, as stored:
    ``{layers_prefix}.{layer_idx}.{moe_layer_attr}.{experts_attr}.{e}.{name}.weight``
    (``float8_e4m3fn``) and ``.weight_scale_inv`` (bf16 or f32 per 128×128 block, returned as
    f32); lists of torch tensors per projection. Fused expert tensors, a missing tensor or a
    shape that differs raise naming the tensor."""
    import torch

    if tuple(block_size) != (128, 128):
        raise KTValueError(f"AMXFP8_SFT needs 128x128 blocks, got {tuple(block_size)}")
    if not checkpoint_files:
        raise KTFileNotFoundError("checkpoint_files is empty")
    h, i = int(hidden_size), int(moe_config.intermediate_size)
    if h % 128 or i % 128:
        raise KTValueError(f"hidden_size {h} and intermediate_size {i} must be multiples of 128 for AMXFP8_SFT")
    prefix = f"{layers_prefix}.{layer_idx}.{moe_config.moe_layer_attr}.{moe_config.experts_attr}"
    where = _tensor_files(checkpoint_files, sharded_metadata)
    fused = [k for k in (f"{prefix}.gate_up_proj", f"{prefix}.gate_up_proj.weight", f"{prefix}.down_proj",
                         f"{prefix}.down_proj.weight") if k in where]
    if fused:
        raise KTValueError(f"AMXFP8_SFT reads per-expert tensors; layer {layer_idx} has fused {fused[0]}")
    out = []
    for name, rows, cols in zip(moe_config.weight_names, (i, i, h), (h, h, i)):
        stems = [f"{prefix}.{e}.{name}" for e in range(int(moe_config.expert_num))]
        t = _read(where, [f"{s}.{x}" for s in stems for x in ("weight", "weight_scale_inv")], layer_idx)
        weights, scales = [], []
        for s in stems:
            w, sc = t[f"{s}.weight"], t[f"{s}.weight_scale_inv"]
            if w.dtype != torch.float8_e4m3fn or tuple(w.shape) != (rows, cols):
                raise KTValueError(f"{s}.weight is {w.dtype} {tuple(w.shape)}, expected float8_e4m3fn {(rows, cols)}")
            if sc.dtype not in (torch.bfloat16, torch.float32) or tuple(sc.shape) != (rows // 128, cols // 128):
                raise KTValueError(f"{s}.weight_scale_inv is {sc.dtype} {tuple(sc.shape)}, expected bf16 or f32 "
                                 f"{(rows // 128, cols // 128)}")
            weights.append(w.contiguous())
            scales.append(sc.to(torch.float32).contiguous())
        out += [weights, scales]
    g, gs, u, us, d, ds = out
    return BlockFP8ExpertWeights(g, gs, u, us, d, ds, block_size=(128, 128))


def _tensor_files(checkpoint_files, sharded_metadata):
    """Tensor name -> the file holding it: from the index's ``weight_map`` when given, else by
    opening each file's header."""
    from safetensors import safe_open

    weight_map = sharded_metadata.get("weight_map") if isinstance(sharded_metadata, Mapping) else None
    if weight_map:
        base = os.path.dirname(checkpoint_files[0])
        return {k: os.path.join(base, f) for k, f in weight_map.items()}
    where = {}
    for f in checkpoint_files:
        with safe_open(f, framework="pt") as handle:
            where.update({k: f for k in handle.keys()})
    return where


def _read(where, keys, layer_idx):
    """Tensors ``keys`` (torch), each file opened once; a missing one raises naming it."""
    from safetensors import safe_open

    by_file: dict[str, list[str]] = {}
    for k in keys:
        if k not in where:
            raise KTFileNotFoundError(f"layer {layer_idx}: the checkpoint has no tensor {k}")
        by_file.setdefault(where[k], []).append(k)
    out = {}
    for f, ks in by_file.items():
        with safe_open(f, framework="pt") as handle:
            out.update({k: handle.get_tensor(k) for k in ks})
    return out
