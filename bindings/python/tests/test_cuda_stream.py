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


def test_sft_serving_goes_through_the_stream_as_inference_does(fake_cuda):
    """The SFT wrapper's serving forward (SGLang's LoRA experts) on a stream: its staging and
    task are host functions on the stream (replays reuse them), and the output equals the same
    forward off the stream and the wrapper's own forward without a cache, bit for bit."""
    from kt_kernel import KTMoEWrapper

    w = KTMoEWrapper(layer_idx=0, num_experts=E, num_experts_per_tok=K, hidden_size=H, moe_intermediate_size=I,
                     cpuinfer_threads=2, threadpool_count=2, weight_path=None, chunked_prefill_size=64,
                     method="AMXBF16_SFT", mode="sft", lora_rank=4, lora_alpha=8.0)
    w.load_weights_from_tensors(*experts(E, H, I, seed=11))
    r = np.random.default_rng(12)
    shapes = [(E, 4, H), (E, I, 4), (E, 4, H), (E, I, 4), (E, 4, I), (E, H, 4)]
    bits = lambda a: ((a.astype(np.float32).view(np.uint32) + 0x8000) >> 16).astype(np.uint16)
    lora = [bits(0.05 * r.standard_normal(s)) for s in shapes]
    w.init_lora_weights(*lora, *[np.zeros_like(m) for m in lora])
    calls = fake_cuda.fake_host_calls()
    for n in (5, 3, 5):  # 5 again: a replay
        x = r.standard_normal((n, H)).astype(np.float32)
        ids, ws = routing(n, K, E, int(r.integers(1 << 30)))
        w.submit_forward_inference(x, ids, ws, STREAM)
        on_stream = w.sync_forward_inference(STREAM)
        fake_cuda.cudaStreamSynchronize(STREAM)
        on_stream = on_stream.copy()
        w.submit_forward_inference(x, ids, ws, 0)
        assert np.array_equal(on_stream, w.sync_forward_inference(0))
        assert np.array_equal(on_stream, w.forward(x, ids, ws, save_for_backward=False))
    assert fake_cuda.fake_host_calls() > calls, "work went through host functions"
    assert w.moe.cache_depth == 0
