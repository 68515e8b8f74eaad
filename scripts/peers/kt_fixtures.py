#!/usr/bin/env python3
"""Write KT-Kernel's own converted files and forward outputs for small layers: the fixtures
that prove our AMXINT8 / AMXINT4 bytes and results are KT's (tests/fixtures/kt/, read by
host/tests/kt_fixtures.rs).

    python3 kt_fixtures.py EXT_SO OUT_DIR

EXT_SO is one of the `_kt_kernel_ext_<variant>.*.so` files of KT-Kernel 0.7.2's wheel (run by
scripts/kt-fixtures.sh, which downloads it; never committed). For each case KT quantizes bf16
weights and writes its raw `.kt` files (`cpu_save`, what its converter
`convert_cpu_weights.py` runs), which are merged as that converter merges them: one
safetensors file, keys `blk.0.ffn_{gate,up,down}_exps.{e}.numa.{n}.weight` (1-D int8, the
packed bytes) and `.scale` (1-D f32). Then KT runs forward passes on them and their outputs
are stored beside (`out.{tokens}`, bf16 bits as u16, with the routing `ids.{tokens}` and
`weights.{tokens}`).

Weights and inputs are not stored: both sides make them from SplitMix64 (seed, index), the
same bits in numpy and in Rust (`kt_core::rng::SplitMix64`): value = (u >> 40) / 2^24 - 1/2,
times 2^-4 for weights, rounded to bf16.
"""

import glob
import os
import re
import sys
import tempfile

import numpy as np
from kt_moe import bf16, load_ext  # beside this file
from safetensors.numpy import save_file

# name, method, experts, top-k, hidden, intermediate, NUMA parts, token counts. 3712 = one
# K block of 3584 and a short one of 128; the second case splits I over two parts.
CASES = [
    ("int8_k3712", "AMXINT8", 1, 1, 3712, 64, 1, [1, 7, 33]),
    ("int4_k3712", "AMXINT4", 1, 1, 3712, 128, 1, [1, 7, 33]),
    ("int8_parts2", "AMXINT8", 3, 2, 256, 128, 2, [1, 5, 40]),
    ("int4_parts2", "AMXINT4", 3, 2, 256, 256, 2, [1, 5, 40]),
]
GAMMA = np.uint64(0x9E3779B97F4A7C15)


def splitmix(seed, n):
    """The first n outputs of SplitMix64(seed)."""
    with np.errstate(over="ignore"):
        z = np.uint64(seed) + (np.arange(1, n + 1, dtype=np.uint64) * GAMMA)
        z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
        return z ^ (z >> np.uint64(31))


def values(seed, shape, scale):
    """bf16 bits of ((u >> 40) / 2^24 - 1/2) · scale, u = SplitMix64(seed)'s outputs."""
    u = splitmix(seed, int(np.prod(shape))) >> np.uint64(40)
    return bf16((u.astype(np.float32) / np.float32(1 << 24) - np.float32(0.5)) * np.float32(scale)).reshape(shape)


def routing(E, k, n, seed):
    """Distinct experts per token and positive weights, from SplitMix64(seed)."""
    u = splitmix(seed, n * (E + k))
    ids = np.stack([np.argsort(u[t * (E + k) : t * (E + k) + E], kind="stable")[:k] for t in range(n)])
    w = ((u[n * E :][: n * k] >> np.uint64(40)).astype(np.float32) / np.float32(1 << 24) + np.float32(0.25)).reshape(n, k)
    return ids.astype(np.int64), w.astype(np.float32)


def merged(scratch, kinds, infix=""):
    """KT's raw per-expert files under `scratch` (`_layer_0/_numa_N/{kinds}_{proj}_{infix}E_NByte_
    {quant|scale}_.kt`, `kinds` a pattern of their int type) as the tensors KT's converter merges
    them into: `blk.0.ffn_{proj}_{infix}exps.{e}.numa.{n}.{weight|scale}`."""
    tensors = {}
    for f in sorted(glob.glob(f"{scratch}/_layer_0/_numa_*/*.kt")):
        numa = int(re.search(r"_numa_(\d+)", f).group(1))
        m = re.fullmatch(rf"{kinds}_(gate|up|down)_{infix}(\d+)_(\d+)Byte_(quant|scale)_\.kt", os.path.basename(f))
        proj, e, nbytes, what = m.group(1), int(m.group(2)), int(m.group(3)), m.group(4)
        raw = np.fromfile(f, dtype=np.int8 if what == "quant" else np.float32)
        assert raw.nbytes == nbytes, f
        tensors[f"blk.0.ffn_{proj}_{infix}exps.{e}.numa.{numa}." + ("weight" if what == "quant" else "scale")] = raw
    return tensors


def case(ext, out_dir, name, method, E, k, H, I, parts, tokens):
    wc = ext.WorkerPoolConfig()
    wc.subpool_count, wc.subpool_numa_map, wc.subpool_thread_count = parts, [0] * parts, [1] * parts
    cpu = ext.CPUInfer(wc)
    gate, up, down = values(1, (E, I, H), 1 / 16), values(2, (E, I, H), 1 / 16), values(3, (E, H, I), 1 / 16)
    mask = np.zeros(E, dtype=bool)
    scratch = tempfile.mkdtemp(prefix="kt_fixture_")
    cfg = ext.moe.MOEConfig(E, k, H, I, mask.ctypes.data)
    cfg.layer_idx, cfg.pool, cfg.max_len = 0, cpu.backend_, 64
    cfg.gate_proj, cfg.up_proj, cfg.down_proj = gate.ctypes.data, up.ctypes.data, down.ctypes.data
    cfg.save, cfg.load, cfg.path = True, False, scratch
    moe = (ext.moe.AMXInt8_MOE if method == "AMXINT8" else ext.moe.AMXInt4_MOE)(cfg)
    ident = np.arange(E, dtype=np.int64)
    cpu.submit(moe.load_weights_task(ident.ctypes.data))
    cpu.sync()
    # Merge the raw files as convert_cpu_weights.py does.
    tensors = merged(scratch, "INT[48]")
    assert len(tensors) == 6 * E * parts, sorted(tensors)
    for n in tokens:
        ids, w = routing(E, k, n, 100 + n)
        x = values(200 + n, (n, H), 1.0)
        out = np.zeros((n, H), dtype=np.uint16)
        bsz = np.array([n], dtype=np.int32)
        cpu.submit(moe.forward_task(bsz.ctypes.data, k, ids.ctypes.data, w.ctypes.data, x.ctypes.data, out.ctypes.data, False))
        cpu.sync()
        tensors[f"out.{n}"], tensors[f"ids.{n}"], tensors[f"weights.{n}"] = out, ids, w
    meta = {"method": method, "experts": str(E), "top_k": str(k), "hidden": str(H), "intermediate": str(I),
            "parts": str(parts), "tokens": ",".join(map(str, tokens)), "kt_variant": getattr(ext, "__cpu_variant__", "?")}
    os.makedirs(f"{out_dir}/{name}", exist_ok=True)
    save_file(tensors, f"{out_dir}/{name}/model-00001-of-00001.safetensors", metadata=meta)
    print(f"kt-fixtures: {name}: {method} E={E} k={k} H={H} I={I} parts={parts} tokens={tokens}", flush=True)


def main():
    ext, out_dir = load_ext(sys.argv[1]), sys.argv[2]
    for c in CASES:
        case(ext, out_dir, *c)


if __name__ == "__main__":
    main()
