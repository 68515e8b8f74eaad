"""SGLang's own KT integration code (`sglang/srt/layers/moe/kt_ep_wrapper.py`, from the PyPI
wheels that scripts/sglang-env.sh unpacks) driving this package, on a CPU-only machine.

`KT_SGLANG_ROOT` names the unpacked tree to import (upstream sglang or KT's fork: both are
the package `sglang`, so one per pytest run; scripts/sglang-tests.sh runs both). What needs a
GPU is stood in for, and only that:
- the GPU MoE kernels: the wrapped GPU method computes its experts in torch fp32 on the CPU
  (`GpuMoe`), and the `sgl_kernel` extension (CUDA-only, imported by the fork's modules) is a
  module whose functions raise;
- CUDA's runtime calls: `torch.cuda.synchronize` does nothing, `current_stream()` is stream 0
  (so our package takes its CPU path), `get_device_capability()` is an H100's (9, 0) (the
  fork asks at import time);
- the launcher's process state: one tensor-parallel rank (rank 0) and the identity
  physical-to-logical expert map (what `get_global_expert_location_metadata` holds without
  expert-parallel load balancing).
"""

import importlib.abc
import importlib.machinery
import json
import os
import pathlib
import sys
import types

import pytest
import torch

ROOT = os.environ.get("KT_SGLANG_ROOT")
if not ROOT or not (pathlib.Path(ROOT) / "sglang").is_dir():
    raise pytest.UsageError("KT_SGLANG_ROOT must name an unpacked sglang wheel (scripts/sglang-tests.sh sets it)")
sys.path.insert(0, ROOT)


def _gpu_only(name):
    if name.startswith("__"):
        raise AttributeError(name)

    def call(*args, **kwargs):
        raise RuntimeError(f"sgl_kernel's {name} needs a GPU (stood in by the tests)")

    return call


class _GpuKernels(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """`sgl_kernel` and its submodules: packages whose every function raises. Left absent:
    `scalar_type`, for which SGLang has its own fallback."""

    def find_spec(self, name, path=None, target=None):
        if name == "sgl_kernel.scalar_type":
            raise ModuleNotFoundError(name)
        if name == "sgl_kernel" or name.startswith("sgl_kernel."):
            return importlib.machinery.ModuleSpec(name, self, is_package=True)
        return None

    def create_module(self, spec):
        return None

    def exec_module(self, module):
        module.__path__ = []
        module.__getattr__ = _gpu_only


sys.meta_path.insert(0, _GpuKernels())
torch.cuda.synchronize = lambda *a, **k: None
torch.cuda.current_stream = lambda *a, **k: types.SimpleNamespace(cuda_stream=0)
torch.cuda.get_device_capability = lambda *a, **k: (9, 0)


E, K, H, I, LAYERS = 8, 2, 256, 512, 3
# Mean relative error against the fp32 MoE (the package tests' limits; FP8's e4m3 rounding,
# 2^-4 per weight, is measured here on single tokens too, where nothing averages it: 0.08).
LIMITS = {"BF16": 0.01, "AMXINT8": 0.04, "AMXINT4": 0.30, "FP8": 0.08, "FP8_PERCHANNEL": 0.08, "MXFP8": 0.06, "MXFP4": 0.30}


def experts(e, h, i, seed):
    """bf16-representable fp32 weights `[E, I, H]`, `[E, I, H]`, `[E, H, I]`."""
    g = torch.Generator().manual_seed(seed)
    w = {
        "gate": torch.randn(e, i, h, generator=g) / h**0.5,
        "up": torch.randn(e, i, h, generator=g) / h**0.5,
        "down": torch.randn(e, h, i, generator=g) / i**0.5,
    }
    return {k: v.to(torch.bfloat16).float() for k, v in w.items()}


def write_checkpoint(d, layers, k):
    """A Hugging Face Qwen3-MoE-style checkpoint of `layers` (bf16, written by safetensors)."""
    from safetensors.torch import save_file

    e, i, h = layers[0]["gate"].shape
    tensors = {}
    for li, w in enumerate(layers):
        for x in range(e):
            for p in ("gate", "up", "down"):
                tensors[f"model.layers.{li}.mlp.experts.{x}.{p}_proj.weight"] = w[p][x].to(torch.bfloat16).contiguous()
    save_file(tensors, str(pathlib.Path(d) / "model.safetensors"))
    cfg = {"num_experts": e, "num_experts_per_tok": k, "hidden_size": h, "moe_intermediate_size": i,
           "num_hidden_layers": len(layers)}
    (pathlib.Path(d) / "config.json").write_text(json.dumps(cfg))


def moe(x, ids, weights, w, on):
    """fp32 MoE over the experts `on(e)` admits; ids < 0 skipped. `w` may carry expert biases
    (`gate_bias`, `up_bias`, `down_bias`) and another activation of gate and up (`glu`)."""
    out = torch.zeros(x.shape, dtype=torch.float32)
    x = x.float()
    glu = w.get("glu", lambda g, u: torch.nn.functional.silu(g) * u)
    bias = lambda name, e: w[name][e] if name in w else 0.0  # noqa: E731
    for t in range(x.shape[0]):
        for j in range(ids.shape[1]):
            e = int(ids[t, j])
            if e >= 0 and on(e):
                h = glu(w["gate"][e] @ x[t] + bias("gate_bias", e), w["up"][e] @ x[t] + bias("up_bias", e))
                out[t] += float(weights[t, j]) * (w["down"][e] @ h + bias("down_bias", e))
    return out


def clamped_glu(alpha, limit):
    """KT's clamped SwiGLU ("swigluoai": gpt-oss's, the gate clamped both ways)."""

    def glu(g, u):
        g, u = g.clamp(-limit, limit), u.clamp(-limit, limit)
        return g * torch.sigmoid(alpha * g) * (u + 1)

    return glu


def rel_err(out, ref):
    return float((out.float() - ref).abs().sum() / ref.abs().sum().clamp_min(1e-30))


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    """The checkpoint's directory and its layers' weights."""
    weights = [experts(E, H, I, seed=li) for li in range(LAYERS)]
    d = tmp_path_factory.mktemp("qwen3-moe")
    write_checkpoint(d, weights, K)
    return str(d), weights


def check_step(layers, weights, n, g, deferred, limit, label):
    """One step of `n` tokens through every `(method, layer)` by SGLang's `apply`: each layer
    against the fp32 MoE of all its experts; with deferred experts (a layer's deferred part is
    added to the next layer's output, the last layer defers none) the sum of the outputs."""
    from sglang.srt.layers.moe.token_dispatcher.standard import StandardDispatchOutput
    from sglang.srt.layers.moe.topk import StandardTopKOutput

    got, want = [], []
    for li, (m, layer) in enumerate(layers):
        x = torch.randn(n, H, generator=g).to(torch.bfloat16)
        logits = torch.randn(n, E, generator=g)
        w, ids = torch.topk(torch.softmax(logits, -1), K)
        ids = ids.to(torch.int32)
        # Upstream masks the CPU experts' ids in place after submitting: keep a copy.
        want.append(moe(x, ids.clone(), w, weights[li], lambda e: True))
        with torch.inference_mode():  # as SGLang's model runner runs a forward
            out = m.apply(layer, StandardDispatchOutput(x, None, StandardTopKOutput(w, ids, logits))).hidden_states
        assert out.shape == x.shape and out.dtype == torch.bfloat16
        got.append(out.float())
        if deferred is None:
            err = rel_err(got[-1], want[-1])
            assert err < limit, f"{label}, layer {li}, {n} tokens: {err}"
    err = rel_err(sum(got), sum(want))
    assert err < limit, f"{label}, {n} tokens, the layers' sum: {err}"
