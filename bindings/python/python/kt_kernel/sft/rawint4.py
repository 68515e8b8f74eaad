"""KT's RAWINT4 SFT surface (what SGLang's KT fork calls to serve expert LoRA on a
compressed-tensors int4 model): signed int4 in groups of 32 along K with one scale per group,
stored as compressed-tensors "pack-quantized" stores it (offset-8 nibbles, the even column in
the low nibble, int32 words or their bytes) and loaded into a ``RAWINT4_SFT`` layer as it is,
without quantizing again (``SFTMoEWrapper.load_rawint4_weights``).

``MOEArchConfig`` and the dataclasses need nothing; ``load_rawint4_experts_from_checkpoint_files``
reads torch tensors (torch and safetensors).
"""

import json
import os
from dataclasses import dataclass
from typing import Any, Mapping

RAWINT4_GROUP_SIZE = 32
RAWINT4_WEIGHT_LAYOUT = "int4-g32: offset-8 nibbles (even column low), one scale per 32 columns"


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


@dataclass(frozen=True)
class RAWINT4Runtime:
    cpu_variant: str
    kernel: str
    weight_layout: str


@dataclass(frozen=True)
class RAWINT4CheckpointContract:
    bits: int = 4
    group_size: int = RAWINT4_GROUP_SIZE
    signed: bool = True
    symmetric: bool = True
    zero_point: bool = False
    format: str = "pack-quantized"


def get_rawint4_runtime():
    """The RAWINT4 SFT runtime: every backend of this build runs int4 groups (their own
    kernels for ``int4-g32``), so it is always there."""
    import kt_kernel

    return RAWINT4Runtime(kt_kernel.__cpu_variant__, f"{kt_kernel.__cpu_variant__}-int4-g32", RAWINT4_WEIGHT_LAYOUT)


def _get(config, name, default=None):
    return config.get(name, default) if isinstance(config, Mapping) else getattr(config, name, default)


def get_rawint4_checkpoint_contract(model_config):
    """Check that a model config (``config.json`` as a dict, or an object) describes weights
    ``RAWINT4_SFT`` loads as they are: compressed-tensors, pack-quantized, compressed, weight-only
    symmetric int4 in static groups of 32 with no zero points. Raises ValueError naming the field
    that differs."""
    quant = _get(model_config, "quantization_config")
    if quant is None and _get(model_config, "text_config") is not None:
        quant = _get(_get(model_config, "text_config"), "quantization_config")
    if quant is None:
        raise ValueError("RAWINT4 SFT needs the model's quantization_config (compressed-tensors int4)")
    norm = lambda v: str(v or "").lower().replace("_", "-")
    for field, want in [("quant_method", "compressed-tensors"), ("format", "pack-quantized"),
                        ("quantization_status", "compressed")]:
        if norm(_get(quant, field)) != want:
            raise ValueError(f"RAWINT4 SFT needs quantization_config.{field} = {want!r}, got {_get(quant, field)!r}")
    groups = _get(quant, "config_groups")
    if not isinstance(groups, Mapping) or not groups:
        raise ValueError("RAWINT4 SFT needs a non-empty quantization_config.config_groups")
    want = {"type": "int", "num_bits": 4, "strategy": "group", "group_size": RAWINT4_GROUP_SIZE, "dynamic": False,
            "symmetric": True, "actorder": None, "block_structure": None}
    schemes = 0
    for name, group in groups.items():
        if _get(group, "input_activations") is not None or _get(group, "output_activations") is not None:
            raise ValueError(f"RAWINT4 SFT needs weight-only quantization; config group {name!r} quantizes activations")
        weights = _get(group, "weights")
        if weights is None:
            continue
        schemes += 1
        found = {k: _get(weights, k) for k in want}
        if found != want:
            raise ValueError(f"RAWINT4 SFT config group {name!r}: weight scheme {found}, expected {want}")
        if (weights.get("zero_point") if isinstance(weights, Mapping) else _get(weights, "zero_point")) is not None:
            raise ValueError(f"RAWINT4 SFT config group {name!r} declares zero points (symmetric weights only)")
    if not schemes:
        raise ValueError("RAWINT4 SFT: quantization_config has no weight scheme")
    return RAWINT4CheckpointContract()


def load_rawint4_experts_from_checkpoint_files(checkpoint_files, sharded_metadata, layers_prefix, moe_config,
                                               layer_idx, hidden_size, group_size=RAWINT4_GROUP_SIZE):
    """Layer ``layer_idx``'s experts from compressed-tensors safetensors files, as stored:
    ``{layers_prefix}.{layer_idx}.{moe_layer_attr}.{experts_attr}.{e}.{name}.weight_packed``
    (int32 ``[rows, cols/8]`` or uint8 ``[rows, cols/2]``), ``.weight_scale`` (bf16 or f32
    ``[rows, cols/32]``) and ``.weight_shape``; torch tensors stacked per projection. A missing
    tensor, a zero point or a shape that differs raises naming the tensor."""
    import torch
    from safetensors import safe_open

    if int(group_size) != RAWINT4_GROUP_SIZE:
        raise ValueError(f"RAWINT4 SFT needs group_size {RAWINT4_GROUP_SIZE}, got {group_size}")
    if not checkpoint_files:
        raise FileNotFoundError("checkpoint_files is empty")
    h, i = int(hidden_size), int(moe_config.intermediate_size)
    if h % group_size or i % group_size:
        raise ValueError(f"hidden_size {h} and intermediate_size {i} must be multiples of the group size {group_size}")
    weight_map = (sharded_metadata or {}).get("weight_map") if isinstance(sharded_metadata, Mapping) else None
    if weight_map:
        base = os.path.dirname(checkpoint_files[0])
        where = {k: os.path.join(base, f) for k, f in weight_map.items()}
    else:
        where = {}
        for f in checkpoint_files:
            with safe_open(f, framework="pt") as handle:
                where.update({k: f for k in handle.keys()})
    prefix = f"{layers_prefix}.{layer_idx}.{moe_config.moe_layer_attr}.{moe_config.experts_attr}"

    def read(keys):
        by_file = {}
        for k in keys:
            if k not in where:
                raise FileNotFoundError(f"layer {layer_idx}: the checkpoint has no tensor {k}")
            by_file.setdefault(where[k], []).append(k)
        out = {}
        for f, ks in by_file.items():
            with safe_open(f, framework="pt") as handle:
                out.update({k: handle.get_tensor(k) for k in ks})
        return out

    stacked = []
    for name, rows, cols in zip(moe_config.weight_names, (i, i, h), (h, h, i)):
        stems = [f"{prefix}.{e}.{name}" for e in range(int(moe_config.expert_num))]
        for s in stems:
            for zp in (f"{s}.weight_zero_point", f"{s}.zero_point"):
                if zp in where:
                    raise ValueError(f"RAWINT4 SFT takes symmetric weights; the checkpoint has {zp}")
        t = read([f"{s}.{x}" for s in stems for x in ("weight_packed", "weight_scale", "weight_shape")])
        packed, scales = [], []
        for s in stems:
            shape = tuple(int(v) for v in t[f"{s}.weight_shape"].reshape(-1).tolist())
            if shape != (rows, cols):
                raise ValueError(f"{s}.weight_shape is {shape}, expected {(rows, cols)}")
            p = t[f"{s}.weight_packed"]
            if p.dtype == torch.int32 and tuple(p.shape) == (rows, cols // 8):
                p = p.contiguous().view(torch.uint8).view(rows, cols // 2)
            elif p.dtype != torch.uint8 or tuple(p.shape) != (rows, cols // 2):
                raise ValueError(f"{s}.weight_packed is {p.dtype} {tuple(p.shape)}, expected int32 "
                                 f"{(rows, cols // 8)} or uint8 {(rows, cols // 2)}")
            sc = t[f"{s}.weight_scale"]
            if sc.dtype not in (torch.bfloat16, torch.float32) or tuple(sc.shape) != (rows, cols // group_size):
                raise ValueError(f"{s}.weight_scale is {sc.dtype} {tuple(sc.shape)}, expected bf16 or f32 "
                                 f"{(rows, cols // group_size)}")
            packed.append(p.contiguous())
            scales.append(sc.to(torch.bfloat16).contiguous())
        stacked += [torch.stack(packed).contiguous(), torch.stack(scales).contiguous()]
    return RAWINT4ExpertWeights(*stacked, group_size=int(group_size))
