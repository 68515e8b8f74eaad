"""The CUDA-stream path on a real GPU with torch: skipped where torch or a GPU is missing.

The checks run in a child process: the CUDA runtime is loaded once per process, and the fake one
(test_cuda_stream.py) may already be loaded in this one. Each compares GPU tensors through the
stream (eagerly and as a replayed CUDA graph) and without one to the same tensors on the CPU: the
bits must be equal. Before each checked GPU forward the staging buffers hold other values and the
GPU is kept busy, so a staging copy that the CPU task does not wait for would be read stale."""

import os
import subprocess
import sys

import numpy as np
import pytest

from conftest import experts, make, routing

E, K, H, I = 16, 4, 512, 768


def _cuda_ready():
    try:
        import torch
    except ImportError:
        return False
    return torch.cuda.is_available()


@pytest.mark.skipif(not _cuda_ready(), reason="needs torch with a CUDA GPU")
def test_real_cuda_stream_eager_and_graph_equal_cpu():
    env = {k: v for k, v in os.environ.items() if k != "KT_KERNEL_CUDART"}
    r = subprocess.run([sys.executable, __file__], env=env, cwd=os.path.dirname(__file__), capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "graph replays equal" in r.stdout, r.stdout


def _busy(torch):
    """Queue a few seconds' worth of GPU work on the current stream."""
    a = torch.randn(4096, 4096, device="cuda")
    for _ in range(20):
        a = torch.tanh(a @ a)


def _layers(method, deferred):
    weights = experts(E, H, I, seed=5)
    layers = [make(layer_idx=li, e=E, k=K, h=H, i=I, method=method, chunk=64, deferred=d) for li, d in enumerate(deferred)]
    for w in layers:
        w.load_weights_from_tensors(*weights)
    return layers


def _inputs(torch, n, seed):
    r = np.random.default_rng(seed)
    x = torch.from_numpy(r.standard_normal((n, H)).astype(np.float32)).to(torch.bfloat16)
    ids, ws = routing(n, K, E, seed)
    return x, torch.from_numpy(ids.astype(np.int64)), torch.from_numpy(ws)


def _cpu_pass(layers, inputs):
    """One pass over the layers with CPU tensors and no stream: the expected bits. Layers share
    one output buffer per token count (as KT's), so each result is copied before the next."""
    return [w.forward(*args, 0).clone() for w, args in zip(layers, inputs)]


def _main():
    import torch

    from kt_kernel import KTMoEWrapper

    layers = _layers("AMXINT8", deferred=[1, 0])
    stream = torch.cuda.current_stream()
    for n in (1, 7, 33):
        inputs = [_inputs(torch, n, seed=100 * n + li) for li in range(len(layers))]
        want = _cpu_pass(layers, inputs)
        gpu = [tuple(t.cuda() for t in args) for args in inputs]
        other = [tuple(t.cuda() for t in _inputs(torch, n, seed=7 + li)) for li in range(len(layers))]
        for s in (stream.cuda_stream, 0):
            for w, args in zip(layers, other):  # the staging buffers now hold other values
                w.forward(*args, s)
            torch.cuda.synchronize()
            _busy(torch)
            got = [w.forward(*args, s).clone() for w, args in zip(layers, gpu)]
            torch.cuda.synchronize()
            for li, (g, e) in enumerate(zip(got, want)):
                assert g.device.type == "cuda"
                assert torch.equal(g.cpu(), e), f"n={n} stream={s} layer {li}: GPU tensors differ from the CPU path"
    print("eager equal")

    n = 4
    KTMoEWrapper.set_capture_batch_sizes([n])
    static = [tuple(t.cuda() for t in _inputs(torch, n, seed=li)) for li in range(len(layers))]
    side = torch.cuda.Stream()
    side.wait_stream(stream)
    with torch.cuda.stream(side):  # warm-up: staging buffers are made outside the capture
        for w, args in zip(layers, static):
            w.forward(*args, side.cuda_stream)
    stream.wait_stream(side)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        cap = torch.cuda.current_stream().cuda_stream
        outs = [w.forward(*args, cap).clone() for w, args in zip(layers, static)]
    for trial in range(3):
        inputs = [_inputs(torch, n, seed=1000 + 10 * trial + li) for li in range(len(layers))]
        want = _cpu_pass(layers, inputs)
        for dst, src in zip(static, inputs):
            for d, s in zip(dst, src):
                d.copy_(s)
        _busy(torch)
        graph.replay()
        torch.cuda.synchronize()
        for li, (g, e) in enumerate(zip(outs, want)):
            assert torch.equal(g.cpu(), e), f"replay {trial} layer {li}: the graph's result differs from the CPU path"
    print("graph replays equal")


if __name__ == "__main__":
    _main()
