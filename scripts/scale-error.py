#!/usr/bin/env python3
"""A layer's output error with absmax and with mse scales, for every format whose scales are
chosen here: our package (``KTMoEWrapper(scales=...)``), and optionally KT-Kernel's own
extension running files written by ``kt convert --scales ...``.

    target/pyenv/bin/python scripts/scale-error.py [--kt EXT_SO] [--tokens 64] [--experts 16]

The layer has qwen3-30b-a3b's H 2048, I 768 and k 8 (fewer experts: the error does not depend
on their count). Weights are Gaussian, Student-t (nu = 5) or Gaussian with outlier input
columns (4 columns 10x), each scaled to std 1/sqrt(fan_in); the reference is the f32 weights'
MoE computed in f64. The error is mean |out - ref| / mean |ref| (KT's test metric, as
``kt bench``'s). With ``--kt`` (a ``_kt_kernel_ext_<variant>`` of KT-Kernel 0.7.2's wheel,
e.g. from ``scripts/peers/kt_wheel.sh``), the same layer is written as a checkpoint, converted
by ``target/release/kt convert --method int4|int8|int4-g32 --parts 1 --scales S`` and run by
KT's AMXInt4_MOE / AMXInt8_MOE (its converted-file path: per-expert pointers to the files'
bytes) and AMXInt4_KGroup_MOE (RAWINT4: our int4-g32 nibbles, scales given as bf16, exact).
Prints one markdown table.

    target/pyenv/bin/python scripts/scale-error.py --convert-time int4,int4-g32,int8,fp8,mxfp4

instead times ``kt convert`` of one whole qwen3-30b-a3b layer (E 128, Gaussian bf16 experts,
1.2 GB, in a temporary directory under /dev/shm) with each rule, alternated, best of three.
"""

import argparse
import contextlib
import json
import os
import subprocess
import sys
import tempfile
import time

import numpy as np

H, I, K = 2048, 768, 8
METHODS = ["AMXINT4", "RAWINT4", "AMXINT8", "FP8", "FP8_PERCHANNEL", "MXFP4", "MXFP8"]
KINDS = ["gaussian", "student-t5", "outlier-cols"]
HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)


def weights(kind, e, seed):
    """gate, up [E, I, H] and down [E, H, I], f32, std 1/sqrt(fan_in)."""
    r = np.random.default_rng(seed)

    def one(shape):
        fan_in = shape[-1]
        if kind == "student-t5":
            x = r.standard_t(5, shape) / np.sqrt(5 / 3)  # unit variance
        else:
            x = r.standard_normal(shape)
        if kind == "outlier-cols":
            cols = r.choice(fan_in, 4, replace=False)
            x[..., cols] *= 10
        return (x / np.sqrt(fan_in)).astype(np.float32)

    return one((e, I, H)), one((e, I, H)), one((e, H, I))


def routing(n, e, seed):
    r = np.random.default_rng(seed)
    ids = np.stack([r.choice(e, size=K, replace=False) for _ in range(n)]).astype(np.int64)
    w = r.random((n, K)) + 0.1
    return ids, (w / w.sum(axis=1, keepdims=True)).astype(np.float32)


def reference(x, ids, w, gate, up, down):
    """The f32 weights' MoE in f64."""
    x = x.astype(np.float64)
    out = np.zeros_like(x)
    for e in range(gate.shape[0]):
        t, j = np.nonzero(ids == e)
        if len(t) == 0:
            continue
        g, u = x[t] @ gate[e].T.astype(np.float64), x[t] @ up[e].T.astype(np.float64)
        h = g / (1 + np.exp(-g)) * u
        out[t] += w[t, j][:, None] * (h @ down[e].T.astype(np.float64))
    return out


def rel_err(out, ref):
    return float(np.abs(np.asarray(out, np.float64) - ref).sum() / np.abs(ref).sum())


def ours(method, scales, layer, x, ids, w):
    from kt_kernel import KTMoEWrapper

    e = layer[0].shape[0]
    m = KTMoEWrapper(layer_idx=0, num_experts=e, num_experts_per_tok=K, hidden_size=H, moe_intermediate_size=I,
                     gpu_experts_mask=None, cpuinfer_threads=2, threadpool_count=1, weight_path="/nonexistent",
                     chunked_prefill_size=max(64, len(x)), method=method, scales=scales)
    t0 = time.perf_counter()
    m.load_weights_from_tensors(*layer, np.arange(e, dtype=np.int64))
    load_s = time.perf_counter() - t0
    return m.forward(x, ids.astype(np.int32), w, 0), load_s


def write_checkpoint(d, layer):
    """The layer as a Hugging Face Qwen3-MoE checkpoint (f32 experts, one MoE layer)."""
    from safetensors.numpy import save_file

    gate, up, down = layer
    e = gate.shape[0]
    t = {}
    for i in range(e):
        for name, a in (("gate_proj", gate[i]), ("up_proj", up[i]), ("down_proj", down[i])):
            t[f"model.layers.0.mlp.experts.{i}.{name}.weight"] = np.ascontiguousarray(a)
    t["model.layers.0.mlp.gate.weight"] = np.zeros((e, H), np.float32)
    save_file(t, os.path.join(d, "model.safetensors"))
    cfg = {"architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe", "hidden_size": H,
           "moe_intermediate_size": I, "num_experts": e, "num_experts_per_tok": K, "num_hidden_layers": 1,
           "decoder_sparse_step": 1, "mlp_only_layers": []}
    with open(os.path.join(d, "config.json"), "w") as f:
        json.dump(cfg, f)


def write_bf16_layer(d, e, seed):
    """One Qwen3-MoE layer of `e` Gaussian experts as a bf16 safetensors checkpoint, written
    expert by expert (the whole layer never in memory as f32)."""
    names, chunks, offset = {}, [], 0
    r = np.random.default_rng(seed)
    for i in range(e):
        for name, shape in (("gate_proj", (I, H)), ("up_proj", (I, H)), ("down_proj", (H, I))):
            a = (r.standard_normal(shape, dtype=np.float32) / np.float32(np.sqrt(shape[1]))).view(np.uint32)
            b = ((a + 0x7FFF + ((a >> 16) & 1)) >> 16).astype(np.uint16).tobytes()
            names[f"model.layers.0.mlp.experts.{i}.{name}.weight"] = {
                "dtype": "BF16", "shape": list(shape), "data_offsets": [offset, offset + len(b)]}
            chunks.append(b)
            offset += len(b)
    header = json.dumps(names).encode()
    header += b" " * (-len(header) % 8)
    with open(os.path.join(d, "model.safetensors"), "wb") as f:
        f.write(len(header).to_bytes(8, "little"))
        f.write(header)
        for b in chunks:
            f.write(b)
    cfg = {"num_experts": e, "num_experts_per_tok": K, "hidden_size": H, "moe_intermediate_size": I,
           "num_hidden_layers": 1}
    with open(os.path.join(d, "config.json"), "w") as f:
        json.dump(cfg, f)


def time_convert(methods):
    kt = os.path.join(ROOT, "target", "release", "kt")
    base = "/dev/shm" if os.path.isdir("/dev/shm") else None
    with tempfile.TemporaryDirectory(dir=base) as d:
        src = os.path.join(d, "ck")
        os.makedirs(src)
        write_bf16_layer(src, 128, 3)
        print("| method | absmax s (best of 3) | mse s | mse / absmax |")
        print("|---|---|---|---|")
        for m in methods:
            best = {"absmax": float("inf"), "mse": float("inf")}
            for _ in range(3):
                for s in ("absmax", "mse"):
                    out = os.path.join(d, "out")
                    subprocess.run(["rm", "-rf", out], check=True)
                    t0 = time.perf_counter()
                    subprocess.run([kt, "convert", "--input", src, "--output", out, "--method", m, "--parts", "1",
                                    "--threads", "2", "--scales", s], check=True, capture_output=True)
                    best[s] = min(best[s], time.perf_counter() - t0)
            print(f"| {m} | {best['absmax']:.2f} | {best['mse']:.2f} | {best['mse'] / best['absmax']:.2f} |", flush=True)


def kt_convert(src, dst, method, scales):
    kt = os.path.join(ROOT, "target", "release", "kt")
    subprocess.run([kt, "convert", "--input", src, "--output", dst, "--method", method, "--parts", "1",
                    "--threads", "2", "--scales", scales], check=True, capture_output=True)
    from safetensors.numpy import load_file

    t = {}
    for f in sorted(os.listdir(dst)):
        if f.endswith(".safetensors"):
            t.update(load_file(os.path.join(dst, f)))
    return t


@contextlib.contextmanager
def quiet():
    """KT's extension prints to the process's stdout: sent to /dev/null meanwhile."""
    sys.stdout.flush()
    saved, null = os.dup(1), os.open(os.devnull, os.O_WRONLY)
    os.dup2(null, 1)
    try:
        yield
    finally:
        os.dup2(saved, 1)
        os.close(null)
        os.close(saved)


class KT:
    """KT-Kernel's extension driven as its wrapper drives converted files (numpy pointers)."""

    def __init__(self, so):
        sys.path.insert(0, os.path.join(HERE, "peers"))
        from kt_moe import bf16, load_ext

        self.bf16 = bf16
        with quiet():
            self.ext = load_ext(so)
            wc = self.ext.WorkerPoolConfig()
            wc.subpool_count, wc.subpool_numa_map, wc.subpool_thread_count = 1, [0], [2]
            self.cpu = self.ext.CPUInfer(wc)

    def run(self, method, tensors, e, x, ids, w):
        ext, keep = self.ext, []
        mask = np.zeros(e, dtype=bool)
        cfg = ext.moe.MOEConfig(e, K, H, I, mask.ctypes.data)
        cfg.layer_idx, cfg.pool, cfg.max_len = 0, self.cpu.backend_, max(64, -(-len(x) // 64) * 64)

        def ptrs(proj, what, as_bf16=False):
            out = []
            for i in range(e):
                a = tensors[f"blk.0.ffn_{proj}_exps.{i}.numa.0.{what}"]
                if as_bf16:
                    a = self.bf16(a.astype(np.float32))
                a = np.ascontiguousarray(a)
                keep.append(a)
                out.append(a.ctypes.data)
            return [out]

        for proj in ("gate", "up", "down"):
            setattr(cfg, f"{proj}_projs", ptrs(proj, "weight"))
            setattr(cfg, f"{proj}_scales", ptrs(proj, "scale", as_bf16=method == "RAWINT4"))
        if method == "RAWINT4":
            qc = cfg.quant_config
            qc.bits, qc.group_size, qc.zero_point = 4, 32, False
            moe = ext.moe.AMXInt4_KGroup_MOE(cfg)
        else:
            cfg.load = True
            moe = (ext.moe.AMXInt4_MOE if method == "AMXINT4" else ext.moe.AMXInt8_MOE)(cfg)
        ident = np.arange(e, dtype=np.int64)
        self.cpu.submit(moe.load_weights_task(ident.ctypes.data))
        self.cpu.sync()
        n = len(x)
        xb, out = self.bf16(x), np.zeros((n, H), dtype=np.uint16)
        bsz, idsc, wc = np.array([n], dtype=np.int32), np.ascontiguousarray(ids), np.ascontiguousarray(w)
        self.cpu.submit(moe.forward_task(bsz.ctypes.data, K, idsc.ctypes.data, wc.ctypes.data, xb.ctypes.data,
                                         out.ctypes.data, False))
        self.cpu.sync()
        return (out.astype(np.uint32) << 16).view(np.float32)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--experts", type=int, default=16)
    ap.add_argument("--kt", help="a _kt_kernel_ext_<variant> .so of KT-Kernel's wheel")
    ap.add_argument("--convert-time", help="time kt convert of a whole qwen3 layer in these methods instead")
    a = ap.parse_args()
    if a.convert_time:
        return time_convert(a.convert_time.split(","))
    kt = KT(a.kt) if a.kt else None
    x = np.random.default_rng(1).standard_normal((a.tokens, H)).astype(np.float32)
    ids, w = routing(a.tokens, a.experts, 2)
    rows = []
    for ki, kind in enumerate(KINDS):
        layer = weights(kind, a.experts, 10 + ki)
        ref = reference(x, ids, w, *layer)
        for method in METHODS:
            got = {s: ours(method, s, layer, x, ids, w) for s in ("absmax", "mse")}
            e = {s: rel_err(out, ref) for s, (out, _) in got.items()}
            rows.append((kind, method, "ours", e["absmax"], e["mse"], got["absmax"][1], got["mse"][1]))
        if kt is not None:
            with tempfile.TemporaryDirectory() as d:
                os.makedirs(os.path.join(d, "ck"))
                write_checkpoint(os.path.join(d, "ck"), layer)
                for method, ours_name in (("AMXINT4", "int4"), ("RAWINT4", "int4-g32"), ("AMXINT8", "int8")):
                    e = {}
                    for s in ("absmax", "mse"):
                        t = kt_convert(os.path.join(d, "ck"), os.path.join(d, f"{ours_name}-{s}"), ours_name, s)
                        with quiet():
                            e[s] = rel_err(kt.run(method, t, a.experts, x, ids, w), ref)
                    rows.append((kind, method, "KT 0.7.2 on kt convert files", e["absmax"], e["mse"], None, None))
    print(f"| weights | method | run by | absmax | mse | change | load s absmax / mse |")
    print("|---|---|---|---|---|---|---|")
    for kind, method, who, ea, em, la, lm in rows:
        load = f"{la:.2f} / {lm:.2f}" if la is not None else ""
        print(f"| {kind} | {method} | {who} | {ea:.4f} | {em:.4f} | {100 * (em / ea - 1):+.1f}% | {load} |")


if __name__ == "__main__":
    main()
