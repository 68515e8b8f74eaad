"""The CUDA-stream protocol against a fake libcudart: submit and sync are host functions on
the stream, in order, and repeated calls (CUDA-graph replays) reuse their argument blocks."""

import numpy as np

from kt_kernel import kt_kernel_ext
from kt_kernel.experts import select_deferred_experts
from conftest import experts, make, moe_reference, rel_err, routing

E, K, H, I = 8, 2, 256, 512
STREAM = 0x5EED


def test_stream_path_equals_cpu_path_and_replays_reuse_blocks(fake_cuda):
    weights = experts(E, H, I, seed=4)
    layers = [make(layer_idx=li, method="AMXINT8", deferred=1 if li < 2 else 0) for li in range(3)]
    for w in layers:
        w.load_weights_from_tensors(*weights)
    r = np.random.default_rng(9)

    def run(n, stream):
        xs = [r.standard_normal((n, H)).astype(np.float32) for _ in layers]
        routes = [routing(n, K, E, int(r.integers(1 << 30))) for _ in layers]
        outs = []
        for w, x, (ids, ws) in zip(layers, xs, routes):
            w.submit_forward(x, ids, ws, stream)
            out = w.sync_forward(x, stream)
            if stream:
                fake_cuda.cudaStreamSynchronize(stream)  # the caller's stream sync
            outs.append(out.copy())
        return xs, routes, outs

    calls = fake_cuda.fake_host_calls()
    xs, routes, on_stream = run(3, STREAM)
    assert fake_cuda.fake_host_calls() > calls, "work went through host functions"
    # Same inputs on the CPU path give the same bits.
    cpu = []
    for w, x, (ids, ws) in zip(layers, xs, routes):
        cpu.append(w.forward(x, ids, ws, 0))
    for a, b in zip(on_stream, cpu):
        assert np.array_equal(a, b)
    # Layer 0 defers each token's lowest-weight expert to layer 1.
    imm, _ = select_deferred_experts(*routes[0], K - 1)
    assert rel_err(on_stream[0], moe_reference(xs[0], imm, routes[0][1], *weights)) < 0.04

    # "Replays": the same token count again and again reuses the callback blocks.
    blocks = kt_kernel_ext.cuda_host_blocks()
    for _ in range(5):
        run(3, STREAM)
    assert kt_kernel_ext.cuda_host_blocks() == blocks


def test_no_cuda_runtime_is_a_clear_error(monkeypatch):
    # Only meaningful before the runtime is first loaded in this process; the fake one may be
    # loaded already, in which case the stream path works and there is nothing to check.
    import os

    if os.environ.get("KT_KERNEL_CUDART"):
        return
    w = make(method="BF16")
    w.load_weights_from_tensors(*experts(E, H, I, seed=1))
    x = np.zeros((1, H), np.float32)
    try:
        w.submit_forward(x, *routing(1, K, E, 1), 1234)
    except RuntimeError as e:
        assert "CUDA runtime" in str(e)
