"""Seeds of the `checkpoint` fuzz target for the encodings SGLang's layerwise prefill copies as
stored (fuzz/seeds/checkpoint/README.md): one-layer checkpoints of two experts written by the
`safetensors` package from torch tensors (numpy has no float8), random values.

    python scripts/fuzz-seeds.py fuzz/seeds/checkpoint   # with torch and safetensors installed
"""

import sys
from pathlib import Path

import torch
from safetensors.torch import save_file

PROJ = {"gate": ("gate_proj", "w1"), "up": ("up_proj", "w3"), "down": ("down_proj", "w2")}


def e4m3(g, rows, cols):
    """Random e4m3 weights (no NaN codes)."""
    return (torch.randn(rows, cols, generator=g) * 0.5).to(torch.float8_e4m3fn)


def e8m0(g, rows, cols):
    """Random e8m0 scale codes around 2^-10."""
    return torch.randint(110, 131, (rows, cols), generator=g, dtype=torch.uint8).view(torch.float8_e8m0fnu)


def experts(h, i, tensors_of):
    """Two experts' tensors: `tensors_of(expert, projection, rows, cols)` gives each's."""
    out = {}
    for e in range(2):
        for p, (rows, cols) in zip(PROJ, [(i, h), (i, h), (h, i)]):
            out.update(tensors_of(e, p, rows, cols))
    return out


def main(out):
    out = Path(out)
    g = torch.Generator().manual_seed(7)
    ds = lambda e, p: f"model.layers.0.mlp.experts.{e}.{PROJ[p][0]}"
    seeds = {
        # DeepSeek-V3's fp8: e4m3 weights, f32 scales per 128 × 128 block (H 128, I 256).
        "deepseek-fp8-block.safetensors": experts(128, 256, lambda e, p, r, c: {
            f"{ds(e, p)}.weight": e4m3(g, r, c),
            f"{ds(e, p)}.weight_scale_inv": torch.rand(r // 128, c // 128, generator=g) * 1e-2,
        }),
        # compressed-tensors' per-channel fp8: one f32 scale a row.
        "fp8-channel.safetensors": experts(64, 64, lambda e, p, r, c: {
            f"{ds(e, p)}.weight": e4m3(g, r, c),
            f"{ds(e, p)}.weight_scale": torch.rand(r, 1, generator=g) * 1e-2,
        }),
        # MXFP8 (the KT fork's MiniMax-M3 layout): e8m0 codes per 32 columns.
        "mxfp8.safetensors": experts(64, 64, lambda e, p, r, c: {
            f"{ds(e, p)}.weight": e4m3(g, r, c),
            f"{ds(e, p)}.weight_scale_inv": e8m0(g, r, c // 32),
        }),
        # DeepSeek-V4-Flash's MXFP4: packed e2m1 pairs as int8, e8m0 `scale` per 32 columns.
        "v4-flash-mxfp4.safetensors": experts(64, 64, lambda e, p, r, c: {
            f"layers.0.ffn.experts.{e}.{PROJ[p][1]}.weight": torch.randint(-128, 128, (r, c // 2), generator=g, dtype=torch.int8),
            f"layers.0.ffn.experts.{e}.{PROJ[p][1]}.scale": e8m0(g, r, c // 32),
        }),
        # bf16 experts, copied as they are stored.
        "qwen3-bf16.safetensors": experts(64, 64, lambda e, p, r, c: {
            f"{ds(e, p)}.weight": (torch.randn(r, c, generator=g) * 0.05).to(torch.bfloat16),
        }),
    }
    for name, tensors in seeds.items():
        save_file(tensors, out / name)
        print(out / name)


if __name__ == "__main__":
    main(sys.argv[1])
