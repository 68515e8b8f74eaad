"""Fixtures: a numpy MoE reference, weight generators, wrapper construction, and the fake
libcudart (built here with the system C compiler) for the CUDA-stream path."""

import ctypes
import json
import os
import pathlib
import subprocess

import numpy as np
import pytest

# Mean relative error limits against an fp32 MoE (the backend issues' thresholds).
LIMITS = {"BF16": 0.01, "FP8": 0.05, "FP8_PERCHANNEL": 0.05, "AMXINT8": 0.04, "AMXINT4": 0.30, "RAWINT4": 0.30,
          "MXFP4": 0.30, "MXFP8": 0.08}


def silu(z):
    return z / (1.0 + np.exp(-z))


def glu(g, u, limit=0.0, alpha=0.0):
    """KT's SwiGLU and its clamped variants (swiglu_limit, swiglu_alpha)."""
    if limit > 0:
        g = np.clip(g, -limit, limit) if alpha > 0 else np.minimum(g, limit)
        u = np.clip(u, -limit, limit)
    if alpha > 0:
        return g / (1.0 + np.exp(-alpha * g)) * (u + 1.0)
    return silu(g) * u


def moe_reference(x, ids, weights, gate, up, down, mask=None, slot_to_logical=None, limit=0.0, alpha=0.0):
    """fp32 MoE: sum over valid, CPU-resident (unmasked) ids of w * down(glu(gate x, up x))."""
    x = np.asarray(x, dtype=np.float64)
    e = gate.shape[0]
    out = np.zeros_like(x)
    for t in range(x.shape[0]):
        for j in range(ids.shape[1]):
            slot = int(ids[t, j])
            if slot < 0 or slot >= e or (mask is not None and mask[slot]):
                continue
            le = slot if slot_to_logical is None else int(slot_to_logical[slot])
            h = glu(gate[le] @ x[t], up[le] @ x[t], limit, alpha)
            out[t] += weights[t, j] * (down[le] @ h)
    return out


def rel_err(out, ref):
    return float(np.abs(np.asarray(out, np.float64) - ref).sum() / max(np.abs(ref).sum(), 1e-30))


def experts(e, h, i, seed):
    r = np.random.default_rng(seed)
    gate = (r.standard_normal((e, i, h)) / np.sqrt(h)).astype(np.float32)
    up = (r.standard_normal((e, i, h)) / np.sqrt(h)).astype(np.float32)
    down = (r.standard_normal((e, h, i)) / np.sqrt(i)).astype(np.float32)
    return gate, up, down


def routing(n, k, e, seed, invalid=False):
    r = np.random.default_rng(seed)
    ids = np.stack([r.choice(e, size=k, replace=False) for _ in range(n)]).astype(np.int32)
    if invalid and n > 1:
        ids[1, 0] = -1
        ids[-1, -1] = e + 3
    w = r.random((n, k)).astype(np.float32) + 0.1
    return ids, (w / w.sum(axis=1, keepdims=True)).astype(np.float32)


def e4m3_values(codes):
    """float32 values of e4m3fn byte codes (no NaN codes given)."""
    c = codes.astype(np.int32)
    sign = np.where(c & 0x80, -1.0, 1.0)
    e, m = (c >> 3) & 0xF, c & 7
    v = np.where(e == 0, m / 8.0 * 2.0**-6, (1 + m / 8.0) * 2.0 ** (e - 7))
    return (sign * v).astype(np.float32)


def bf16_bits(a):
    """float32 -> bfloat16 bits (round to nearest even), as uint16."""
    u = np.asarray(a, np.float32).view(np.uint32).astype(np.uint64)
    return ((u + 0x7FFF + ((u >> 16) & 1)) >> 16).astype(np.uint16)


def write_safetensors(path, tensors):
    """``{name: (dtype, shape, raw bytes)}`` as a safetensors file, written by hand (8-byte header
    length, JSON header, data) as the format specifies: numpy's safetensors API has neither
    bfloat16 nor float8."""
    header, blobs, at = {}, [], 0
    for name, (dtype, shape, b) in tensors.items():
        header[name] = {"dtype": dtype, "shape": list(shape), "data_offsets": [at, at + len(b)]}
        blobs.append(b)
        at += len(b)
    h = json.dumps(header).encode()
    h += b" " * (-len(h) % 8)
    with open(path, "wb") as f:
        f.write(len(h).to_bytes(8, "little") + h + b"".join(blobs))


def write_bf16_safetensors(path, tensors):
    """float arrays as a bf16 safetensors file."""
    write_safetensors(path, {n: ("BF16", a.shape, bf16_bits(a).tobytes()) for n, a in tensors.items()})


def write_config(d, e, k, h, i, layers):
    cfg = {"num_experts": e, "num_experts_per_tok": k, "hidden_size": h, "moe_intermediate_size": i, "num_hidden_layers": layers}
    (pathlib.Path(d) / "config.json").write_text(json.dumps(cfg))


def make(layer_idx=0, e=8, k=2, h=256, i=512, method="BF16", mask=None, chunk=64, deferred=None, path="/nonexistent/kt-weights",
         limit=0.0, alpha=0.0, scales="absmax"):
    from kt_kernel import KTMoEWrapper

    return KTMoEWrapper(
        layer_idx=layer_idx,
        num_experts=e,
        num_experts_per_tok=k,
        hidden_size=h,
        moe_intermediate_size=i,
        gpu_experts_mask=mask,
        cpuinfer_threads=2,
        threadpool_count=2,
        numa_nodes=None,
        weight_path=path,
        chunked_prefill_size=chunk,
        swiglu_limit=limit,
        swiglu_alpha=alpha,
        method=method,
        max_deferred_experts_per_token=deferred,
        scales=scales,
    )


@pytest.fixture(scope="session")
def fake_cuda(tmp_path_factory):
    """Build the fake libcudart, point kt_kernel at it, return it (ctypes)."""
    src = pathlib.Path(__file__).with_name("fake_cudart.c")
    lib = tmp_path_factory.mktemp("cuda") / "libfakecudart.so"
    subprocess.run(["cc", "-shared", "-fPIC", "-O2", "-o", str(lib), str(src), "-lpthread"], check=True)
    os.environ["KT_KERNEL_CUDART"] = str(lib)
    cuda = ctypes.CDLL(str(lib))
    cuda.fake_host_calls.restype = ctypes.c_long
    cuda.cudaStreamSynchronize.argtypes = [ctypes.c_void_p]
    return cuda
