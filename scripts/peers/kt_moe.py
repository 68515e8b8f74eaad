#!/usr/bin/env python3
"""Time one MoE layer on KT-Kernel's own CPU extension, the way its Python wrapper drives it.

    python3 kt_moe.py EXT_SO --method AMXINT8 --tokens 1,256 --threads 2 [--preset qwen3-30b-a3b]

EXT_SO is one of the `_kt_kernel_ext_<variant>.*.so` files of KT-Kernel's wheel (unpacked by
scripts/peer-kt.sh, never committed). It loads without torch: weights, routing and buffers are
numpy arrays handed to it by pointer, as `kt_kernel.utils.amx` hands torch tensors. Prints one
line per token count: `KT <variant> <method> <preset> n=<n> best <ms> ms median <ms> ms reps <r>
queued <ms> ms`. `best`/`median` time one forward from submit to sync, as a caller waiting on
each layer sees it; KT's `sync` polls with a coarse sleep (per-call times land on multiples of
about 4 ms here), so `queued` also gives the best time per forward with 10 forwards queued
before one sync (its worker runs them back to back): the kernels' own speed.

Methods (KT's names and the extension classes its wrapper picks for them on an AVX-512 build,
then on its AVX2 build): AMXINT8 (AMXInt8_MOE) and AMXINT4 (AMXInt4_MOE) quantized online from
bf16 weights (no AVX2 class), BF16 (AMXBF16_MOE, AVX2BF16_MOE), FP8 (AMXFP8_MOE, AVX2FP8_MOE;
e4m3 with 128x128 block scales), RAWINT4 (AMXInt4_KGroup_MOE, AVX2RawInt4_MOE; offset-8 nibbles
with bf16 scales per 32 columns), MXFP4 (AMXFP4_KGroup_MOE, AVX2MXFP4_MOE; e2m1 nibbles, low
nibble first, with power-of-two bf16 scales per 32 columns) and MXFP8 (AMXMXFP8_KGroup_MOE,
AVX2MXFP8_MOE; e4m3 with e8m0 byte scales per 32 columns).
"""

import argparse
import importlib.util
import itertools
import statistics
import sys
import tempfile
import time

import numpy as np

PRESETS = {  # E, k, H, I (kt bench's presets)
    "qwen3-30b-a3b": (128, 8, 2048, 768),
    "deepseek-v2-lite": (64, 6, 2048, 1408),
}


def load_ext(path):
    spec = importlib.util.spec_from_file_location("kt_kernel_ext", path)
    m = importlib.util.module_from_spec(spec)
    sys.modules["kt_kernel_ext"] = m
    spec.loader.exec_module(m)
    return m


def bf16(x):
    """float32 -> bf16 bits (round to nearest even) as uint16."""
    b = np.ascontiguousarray(x, dtype=np.float32).view(np.uint32)
    return ((b + 0x7FFF + ((b >> 16) & 1)) >> 16).astype(np.uint16)


E2M1 = np.array([0, 0.5, 1, 1.5, 2, 3, 4, 6], dtype=np.float32)


def mx_groups(x, largest):
    """Rows of x in groups of 32 and each group's power-of-two scale exponent (OCP MX: the
    group's largest magnitude over the element type's largest, rounded up)."""
    g = x.reshape(x.shape[0], -1, 32)
    amax = np.maximum(np.abs(g).max(axis=2), 1e-30)
    return g, np.ceil(np.log2(amax / largest)).astype(np.int32)


def e2m1(x):
    """float32 in e2m1's range -> 4-bit codes (nearest magnitude, sign in bit 3)."""
    idx = np.abs(np.abs(x)[..., None] - E2M1).argmin(axis=-1).astype(np.uint8)
    return idx | np.where(x < 0, 8, 0).astype(np.uint8)


def fp8_e4m3(x):
    """float32 in e4m3's range -> e4m3 bytes (nearest, by table of all 127 positive codes)."""
    codes = np.arange(128, dtype=np.uint8)
    e, m = codes >> 3, (codes & 7).astype(np.float32)
    vals = np.where(e == 0, m / 8 * 2.0**-6, (1 + m / 8) * 2.0 ** (e.astype(np.float32) - 7))
    vals[127] = np.inf  # NaN code: never chosen
    a = np.abs(x)
    idx = np.searchsorted(vals, a).clip(1, 126)
    idx -= (a - vals[idx - 1]) < (vals[idx] - a)
    return (idx.astype(np.uint8) | np.where(x < 0, 0x80, 0).astype(np.uint8)).astype(np.uint8)


CLASSES = {  # KT's wrapper's choice: the AMX/AVX-512 class where the build has it, else AVX2's
    "AMXINT8": ["AMXInt8_MOE"],
    "AMXINT4": ["AMXInt4_MOE"],
    "BF16": ["AMXBF16_MOE", "AVX2BF16_MOE"],
    "FP8": ["AMXFP8_MOE", "AVX2FP8_MOE"],
    "RAWINT4": ["AMXInt4_KGroup_MOE", "AVX2RawInt4_MOE"],
    "MXFP4": ["AMXFP4_KGroup_MOE", "AVX2MXFP4_MOE"],
    "MXFP8": ["AMXMXFP8_KGroup_MOE", "AVX2MXFP8_MOE"],
}


def kt_class(ext, method):
    # KT's wrapper takes its AMX MXFP8 class only where the CPU has AMX tiles (it would fault).
    amx = "amx_tile" in open("/proc/cpuinfo").read()
    for name in CLASSES[method]:
        if hasattr(ext.moe, name) and (amx or name != "AMXMXFP8_KGroup_MOE"):
            return getattr(ext.moe, name)
    sys.exit(f"this KT build ({getattr(ext, '__cpu_variant__', '?')}) has no class for {method}: {CLASSES[method]}")


class Layer:
    """One layer's weights in the method's stored form, and the extension's MoE object."""

    def __init__(self, ext, method, E, k, H, I, max_len, pool, rng):
        self.keep = []  # arrays the extension points into
        self.mask = np.zeros(E, dtype=bool)
        cfg = ext.moe.MOEConfig(E, k, H, I, self.mask.ctypes.data)
        cfg.layer_idx = 0
        cfg.pool = pool
        cfg.max_len = max_len
        std = lambda fan_in: 1.0 / np.sqrt(fan_in)
        shapes = {"gate": (I, H), "up": (I, H), "down": (H, I)}
        if method in ("AMXINT8", "AMXINT4"):
            for p, (n, kk) in shapes.items():
                w = bf16(rng.standard_normal((E, n, kk), dtype=np.float32) * std(kk))
                self.keep.append(w)
                setattr(cfg, f"{p}_proj", w.ctypes.data)
            cfg.save, cfg.load = False, False
            cfg.path = tempfile.mkdtemp(prefix="kt_peer_")
            cls = kt_class(ext, method)
        else:
            for p, (n, kk) in shapes.items():
                ptrs, sptrs = [], []
                for _ in range(E):
                    x = rng.standard_normal((n, kk), dtype=np.float32) * std(kk)
                    if method == "BF16":
                        w, s = bf16(x), None
                    elif method == "FP8":
                        bs = np.abs(x.reshape(n // 128, 128, kk // 128, 128)).max(axis=(1, 3)) / 448.0
                        w = fp8_e4m3(x / np.repeat(np.repeat(bs, 128, 0), 128, 1))
                        s = bs.astype(np.float32)
                    elif method == "MXFP4":
                        g, e = mx_groups(x, 6.0)
                        q = e2m1(g / np.exp2(e)[..., None].astype(np.float32)).reshape(n, kk)
                        w = (q[:, 0::2] | (q[:, 1::2] << 4)).astype(np.uint8)
                        s = ((e + 127).astype(np.uint16) << 7).astype(np.uint16)  # bf16 of 2^e
                    elif method == "MXFP8":
                        g, e = mx_groups(x, 448.0)
                        w = fp8_e4m3(g / np.exp2(e)[..., None].astype(np.float32)).reshape(n, kk)
                        s = (e + 127).astype(np.uint8)
                    else:  # RAWINT4, group 32: value = (nibble - 8) * scale
                        g = x.reshape(n, kk // 32, 32)
                        sc = np.abs(g).max(axis=2) / 7.0
                        q = (np.rint(g / sc[..., None]).clip(-8, 7) + 8).astype(np.uint8).reshape(n, kk)
                        w = (q[:, 0::2] | (q[:, 1::2] << 4)).astype(np.uint8)
                        s = bf16(sc)
                    w = np.ascontiguousarray(w)
                    self.keep.append(w)
                    ptrs.append(w.ctypes.data)
                    if s is not None:
                        s = np.ascontiguousarray(s)
                        self.keep.append(s)
                    sptrs.append(0 if s is None else s.ctypes.data)
                setattr(cfg, f"{p}_projs", [ptrs])
                setattr(cfg, f"{p}_scales", [sptrs])
            qc = cfg.quant_config
            quant = {"FP8": (8, 128), "RAWINT4": (4, 32), "MXFP4": (4, 32), "MXFP8": (8, 32)}
            bits, group = quant.get(method, (0, 0))
            if bits:
                qc.bits, qc.group_size, qc.zero_point = bits, group, False
            cls = kt_class(ext, method)
        self.cfg = cfg
        self.moe = cls(cfg)
        self.map = np.arange(E, dtype=np.int64)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("ext")
    ap.add_argument("--method", required=True, choices=sorted(CLASSES))
    ap.add_argument("--preset", default="qwen3-30b-a3b", choices=sorted(PRESETS))
    ap.add_argument("--tokens", default="1,256")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--min-time", type=float, default=1.0)
    a = ap.parse_args()
    E, k, H, I = PRESETS[a.preset]
    tokens = [int(t) for t in a.tokens.split(",")]
    ext = load_ext(a.ext)
    wc = ext.WorkerPoolConfig()
    wc.subpool_count, wc.subpool_numa_map, wc.subpool_thread_count = 1, [0], [a.threads]
    cpu = ext.CPUInfer(wc)
    rng = np.random.default_rng(42)
    # KT's wrapper passes chunked_prefill_size; its buffers need a multiple of its M step (32).
    max_len = -(-max(tokens) // 64) * 64
    layer = Layer(ext, a.method, E, k, H, I, max_len, cpu.backend_, rng)
    cpu.submit(layer.moe.load_weights_task(layer.map.ctypes.data))
    cpu.sync()
    for n in tokens:
        # Several routings, cycled, so that few-token forwards touch every expert in turn and
        # stream their weights from DRAM, as `kt bench` does by rotating layers (one routing
        # would keep its few experts in a large L3).
        tasks = []
        for _ in range(max(1, 64 // n)):
            ids = np.stack([rng.choice(E, k, replace=False) for _ in range(n)]).astype(np.int64)
            w = rng.random((n, k), dtype=np.float32)
            x = bf16(rng.standard_normal((n, H), dtype=np.float32))
            out = np.zeros((n, H), dtype=np.uint16)
            bsz = np.array([n], dtype=np.int32)

            def forward(ids=ids, w=w, x=x, out=out, bsz=bsz):  # this routing's arrays, kept alive
                return layer.moe.forward_task(
                    bsz.ctypes.data, k, ids.ctypes.data, w.ctypes.data, x.ctypes.data, out.ctypes.data, False
                )

            tasks.append(forward)
        turns = itertools.cycle(tasks)
        task = lambda: next(turns)()  # noqa: E731
        for _ in range(3):
            cpu.submit(task())
            cpu.sync()
        times, start = [], time.perf_counter()
        while len(times) < 3 or time.perf_counter() - start < a.min_time:
            t0 = time.perf_counter()
            cpu.submit(task())
            cpu.sync()
            times.append((time.perf_counter() - t0) * 1e3)
        queued, start = [], time.perf_counter()
        while len(queued) < 3 or time.perf_counter() - start < a.min_time:
            t0 = time.perf_counter()
            for _ in range(10):
                cpu.submit(task())
            cpu.sync()
            queued.append((time.perf_counter() - t0) * 1e3 / 10)
        variant = getattr(ext, "__cpu_variant__", "?")
        print(
            f"KT {variant} {a.method} {a.preset} n={n} best {min(times):.3f} ms "
            f"median {statistics.median(times):.3f} ms reps {len(times)} queued {min(queued):.3f} ms",
            flush=True,
        )


if __name__ == "__main__":
    main()
