"""Numerics of every wired method against a numpy MoE, live masks, expert maps, SGLang's call
sequence with deferred experts, bad input, and the GIL."""

import threading

import numpy as np
import pytest

from conftest import LIMITS, experts, make, moe_reference, rel_err, routing, write_bf16_safetensors, write_config

E, K, H, I = 8, 2, 256, 512


@pytest.fixture(scope="module")
def weights():
    return experts(E, H, I, seed=1)


@pytest.mark.parametrize("method", sorted(LIMITS))
def test_each_method_matches_the_fp32_moe(method, weights):
    w = make(method=method)
    w.load_weights_from_tensors(*weights, np.arange(E, dtype=np.int64))
    for n, seed in [(1, 2), (7, 3), (33, 4)]:
        x = np.random.default_rng(seed).standard_normal((n, H)).astype(np.float32)
        ids, ws = routing(n, K, E, seed, invalid=True)
        out = w.forward(x, ids, ws, 0)
        assert out.shape == (n, H) and out.dtype == np.float32
        err = rel_err(out, moe_reference(x, ids, ws, *weights))
        assert err < LIMITS[method], f"{method} n={n}: {err}"


@pytest.mark.parametrize("method", ["AMXINT4", "RAWINT4", "MXFP4"])
def test_mse_scales_lower_the_layers_error(method, weights):
    """scales="mse" (the error-minimizing search) against KT's absmax on the same weights: the
    4-bit formats' layer error against the fp32 MoE drops (per-row int4 most, MXFP4's
    power-of-two scales least)."""
    x = np.random.default_rng(21).standard_normal((16, H)).astype(np.float32)
    ids, ws = routing(16, K, E, 22)
    ref = moe_reference(x, ids, ws, *weights)
    errs = {}
    for scales in ("absmax", "mse"):
        w = make(method=method, scales=scales)
        w.load_weights_from_tensors(*weights)
        errs[scales] = rel_err(w.forward(x, ids, ws), ref)
    assert errs["mse"] < {"AMXINT4": 0.85, "RAWINT4": 0.95, "MXFP4": 0.99}[method] * errs["absmax"], errs


def test_scales_are_checked():
    with pytest.raises(ValueError, match=r"Unsupported scales: 'l2'"):
        make(method="AMXINT4", scales="l2")
    with pytest.raises(ValueError, match="bf16 has none"):
        make(method="BF16", scales="mse")
    with pytest.raises(ValueError, match=r"scales 'mse' is not supported with method LLAMAFILE: its GGUF types"):
        make(method="LLAMAFILE", scales="mse")
    from kt_kernel import KTMoEWrapper

    with pytest.raises(ValueError, match="SFT layers quantize with absmax"):
        KTMoEWrapper(layer_idx=0, num_experts=E, num_experts_per_tok=K, hidden_size=H, moe_intermediate_size=I,
                     cpuinfer_threads=2, threadpool_count=1, chunked_prefill_size=64, method="AMXBF16_SFT",
                     mode="sft", scales="mse")


@pytest.mark.parametrize("method", ["MXFP4", "MXFP8"])
@pytest.mark.parametrize("limit, alpha", [(0.5, 0.0), (0.5, 1.702), (0.0, 1.702)])
def test_mx_methods_with_kts_clamped_swiglu(method, limit, alpha, weights):
    """swiglu_limit / swiglu_alpha (accepted for MX methods, as KT) change the activation as
    KT's act_fn does: each variant matches the fp32 MoE with the same variant, and differs from
    plain SwiGLU by far more than the quantization error."""
    w = make(method=method, limit=limit, alpha=alpha)
    w.load_weights_from_tensors(*weights)
    x = np.random.default_rng(9).standard_normal((9, H)).astype(np.float32)
    ids, ws = routing(9, K, E, 9)
    out = w.forward(x, ids, ws)
    assert rel_err(out, moe_reference(x, ids, ws, *weights, limit=limit, alpha=alpha)) < LIMITS[method]
    assert rel_err(out, moe_reference(x, ids, ws, *weights)) > 2 * LIMITS[method]
    with pytest.raises(ValueError, match="only supported for MXFP4/MXFP8"):
        make(method="BF16", limit=limit, alpha=alpha)


def test_float16_in_float16_out_and_bf16_weights_by_bits(weights):
    w = make(method="BF16")
    w.load_weights_from_tensors(*(a.astype(np.float16) for a in weights))
    x = np.random.default_rng(5).standard_normal((4, H)).astype(np.float16)
    ids, ws = routing(4, K, E, 5)
    out = w.forward(x, ids, ws)
    assert out.dtype == np.float16
    assert rel_err(out, moe_reference(x.astype(np.float32), ids, ws, *weights)) < 0.01


class DLPackOnly:
    """A tensor that only speaks DLPack (as jax's or another framework's host arrays do)."""

    def __init__(self, a):
        self._a, self.shape, self.dtype = a, a.shape, a.dtype

    def __dlpack__(self, **kwargs):
        return self._a.__dlpack__(**kwargs)

    def __dlpack_device__(self):
        return self._a.__dlpack_device__()


def test_dlpack_producers_are_read_like_arrays(weights):
    w = make(method="BF16")
    w.load_weights_from_tensors(*(DLPackOnly(a) for a in weights), DLPackOnly(np.arange(E, dtype=np.int64)))
    x = np.random.default_rng(8).standard_normal((3, H)).astype(np.float32)
    ids, ws = routing(3, K, E, 8)
    out = w.forward(DLPackOnly(x), DLPackOnly(ids), DLPackOnly(ws))
    assert isinstance(out, np.ndarray) and out.shape == (3, H)
    np.testing.assert_array_equal(out, w.forward(x, ids, ws))
    assert rel_err(out, moe_reference(x, ids, ws, *weights)) < 0.01


def test_mask_is_read_live(weights):
    w = make(method="BF16")
    w.load_weights_from_tensors(*weights)
    x = np.random.default_rng(6).standard_normal((5, H)).astype(np.float32)
    ids, ws = routing(5, K, E, 6)
    before = w.forward(x, ids, ws)
    w.gpu_experts_mask[[1, 4, 6]] = True  # in place, as SGLang's dynamic expert update does
    after = w.forward(x, ids, ws)
    mask = np.zeros(E, bool)
    mask[[1, 4, 6]] = True
    assert rel_err(after, moe_reference(x, ids, ws, *weights, mask=mask)) < 0.01
    assert not np.allclose(before, after)
    w.gpu_experts_mask[:] = True
    assert not w.forward(x, ids, ws).any(), "every expert on the GPU: the CPU adds exactly 0"


def test_num_gpu_experts_skips_the_same_experts_as_the_mask(weights):
    """Upstream SGLang's num_gpu_experts=3 and KT's fork's mask of experts 0-2 compute the same."""
    from kt_kernel import KTMoEWrapper

    common = dict(layer_idx=0, num_experts=E, num_experts_per_tok=K, hidden_size=H, moe_intermediate_size=I,
                  cpuinfer_threads=2, threadpool_count=2, weight_path="/nonexistent", chunked_prefill_size=16,
                  method="BF16")
    by_count = KTMoEWrapper(num_gpu_experts=3, **common)
    by_mask = KTMoEWrapper(gpu_experts_mask=np.arange(E) < 3, **common)
    for w in (by_count, by_mask):
        w.load_weights_from_tensors(*weights)
    x = np.random.default_rng(3).standard_normal((4, H)).astype(np.float32)
    ids, ws = routing(4, K, E, 3)
    out = by_count.forward(x, ids, ws)
    np.testing.assert_array_equal(out, by_mask.forward(x, ids, ws))
    assert rel_err(out, moe_reference(x, ids, ws, *weights, mask=np.arange(E) < 3)) < 0.01


def test_physical_to_logical_map(weights):
    w = make(method="AMXINT8")
    m = np.arange(E, dtype=np.int64)[::-1].copy()
    w.load_weights_from_tensors(*weights, m)
    x = np.random.default_rng(7).standard_normal((6, H)).astype(np.float32)
    ids, ws = routing(6, K, E, 7)
    err = rel_err(w.forward(x, ids, ws), moe_reference(x, ids, ws, *weights, slot_to_logical=m))
    assert err < LIMITS["AMXINT8"]
    with pytest.raises(ValueError, match="physical_to_logical_map"):
        w.load_weights_from_tensors(*weights, np.full(E, E + 1))


def deferred_reference(layers, xs, ids, ws, weights, d, masks):
    """KT's deferral, with a dense layer in between handled (the deferred part is added at the
    next KT layer): returns each KT layer's CPU output."""
    from kt_kernel.experts import select_deferred_experts

    outs, carry = [], None
    for li, (x, i_, w_) in enumerate(zip(xs, ids, ws)):
        dd = d[li]
        imm, dfr = select_deferred_experts(i_, w_, K - dd) if dd else (i_, None)
        out = moe_reference(x, imm, w_, *weights[li], mask=masks[li])
        if carry is not None:
            out = out + carry
        carry = moe_reference(x, dfr, w_, *weights[li], mask=masks[li]) if dd else None
        outs.append(out)
    return outs


@pytest.mark.parametrize("layer_ids", [[0, 1, 2, 3], [0, 1, 3, 4]], ids=["consecutive", "dense-layer-2"])
def test_sglang_call_sequence_with_deferred_experts(layer_ids, tmp_path):
    """SGLang's hybrid path: keyword construction, capture sizes, load_weights(arange(E)) from
    the checkpoint directory, then per layer submit/sync with max_deferred 1 (0 on the last),
    the mask updated in place between steps."""
    from kt_kernel import KTMoEWrapper

    KTMoEWrapper.set_capture_batch_sizes([1, 2, 4])
    weights = {lid: experts(E, H, I, seed=10 + lid) for lid in layer_ids}
    tensors = {}
    for lid, (g, u, d) in weights.items():
        for e in range(E):
            for proj, m in [("gate", g[e]), ("up", u[e]), ("down", d[e])]:
                tensors[f"model.layers.{lid}.mlp.experts.{e}.{proj}_proj.weight"] = m
    write_bf16_safetensors(tmp_path / "model.safetensors", tensors)
    write_config(tmp_path, E, K, H, I, max(layer_ids) + 1)
    layer_w = [weights[lid] for lid in layer_ids]
    masks0 = [np.arange(E) % 4 == li for li in range(4)]
    deferral = [1, 1, 1, 0]
    wrappers = []
    for li, lid in enumerate(layer_ids):
        w = make(layer_idx=lid, mask=masks0[li], deferred=deferral[li], method="BF16", path=str(tmp_path))
        w.load_weights(np.arange(E, dtype=np.int64))
        wrappers.append(w)
    for step, n in enumerate([1, 3, 4]):
        r = np.random.default_rng(100 + step)
        xs = [r.standard_normal((n, H)).astype(np.float32) for _ in wrappers]
        routes = [routing(n, K, E, 200 + 10 * step + li) for li in range(4)]
        masks = [w.gpu_experts_mask.copy() for w in wrappers]
        outs = []
        for w, x, (ids, ws) in zip(wrappers, xs, routes):
            w.submit_forward(x, ids, ws, 0)
            outs.append(w.sync_forward(x, 0))
        want = deferred_reference(wrappers, xs, [i for i, _ in routes], [w for _, w in routes], layer_w, deferral, masks)
        for li, (o, ref) in enumerate(zip(outs, want)):
            assert rel_err(o, ref) < 0.01, f"step {step} layer {layer_ids[li]}: {rel_err(o, ref)}"
        for li, w in enumerate(wrappers):  # dynamic expert update between steps
            w.gpu_experts_mask[:] = np.roll(w.gpu_experts_mask, 1)
    KTMoEWrapper.set_capture_batch_sizes([])


def test_bad_forward_input_raises_clear_errors(weights):
    w = make(method="BF16", chunk=8)
    x = np.zeros((3, H), np.float32)
    ids, ws = routing(3, K, E, 1)
    with pytest.raises(RuntimeError, match="load_weights"):
        w.forward(x, ids, ws)
    w.load_weights_from_tensors(*weights)
    with pytest.raises(ValueError, match="chunked_prefill_size=8"):
        w.forward(np.zeros((9, H), np.float32), *routing(9, K, E, 1))
    with pytest.raises(ValueError, match=f"\\[N, {H}\\]"):
        w.forward(np.zeros((3, H + 1), np.float32), ids, ws)
    with pytest.raises(ValueError, match="topk_ids"):
        w.forward(x, ids[:, :1], ws)
    with pytest.raises(TypeError, match="integer"):
        w.forward(x, ids.astype(np.float32), ws)
    with pytest.raises(ValueError, match="gate_proj"):
        w.load_weights_from_tensors(weights[0][:, :, :-1], *weights[1:])
    with pytest.raises(TypeError, match="share a dtype"):
        w.load_weights_from_tensors(weights[0], weights[1].astype(np.float16), weights[2])
    # Out-of-range ids are skipped (KT semantics), strided input is copied: no error, right answer.
    bad = ids.copy()
    bad[0, 0] = 10**9
    strided = np.zeros((3, 2 * H), np.float32)[:, ::2]
    strided[:] = np.random.default_rng(2).standard_normal((3, H))
    assert rel_err(w.forward(strided, bad, ws), moe_reference(strided, bad, ws, *weights)) < 0.01


def test_the_gil_is_released_during_compute():
    big_h, big_i = 1024, 2048
    w = make(method="BF16", h=big_h, i=big_i, chunk=256)
    w.load_weights_from_tensors(*experts(E, big_h, big_i, seed=3))
    x = np.random.default_rng(1).standard_normal((256, big_h)).astype(np.float32)
    ids, ws = routing(256, K, E, 1)
    w.forward(x, ids, ws)  # warm up
    counter, stop = [0], threading.Event()

    def spin():
        while not stop.is_set():
            counter[0] += 1

    t = threading.Thread(target=spin)
    t.start()
    try:
        w.submit_forward(x, ids, ws, 0)
        before = counter[0]
        w.sync_forward(x, 0)  # blocks in Rust, GIL released
        during = counter[0] - before
    finally:
        stop.set()
        t.join()
    assert during > 1000, f"the Python thread advanced only {during} times during a forward"


def test_two_python_threads_on_different_layers_give_one_threads_bits():
    """Two threads drive two layers (their own weights and methods) at once through the shared
    pool, each many forwards of several sizes: every output is bit-identical to the same
    forward run alone."""
    layers = []
    for layer_idx, method, seed in [(3, "BF16", 41), (4, "AMXINT8", 42)]:
        w = make(layer_idx=layer_idx, method=method)
        w.load_weights_from_tensors(*experts(E, H, I, seed=seed))
        layers.append(w)
    rng = np.random.default_rng(5)
    cases = []
    for n in [1, 3, 17, 64]:
        x = rng.standard_normal((n, H)).astype(np.float32)
        cases.append((x, *routing(n, K, E, n)))
    alone = [[w.forward(*c).copy() for c in cases] for w in layers]
    got, errors = [[None] * 40 for _ in layers], []

    def drive(li):
        try:
            for r in range(40):
                got[li][r] = layers[li].forward(*cases[r % len(cases)]).copy()
        except Exception as e:  # reported below, with the thread's layer
            errors.append((li, e))

    threads = [threading.Thread(target=drive, args=(li,)) for li in range(len(layers))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    for li in range(len(layers)):
        for r in range(40):
            assert np.array_equal(got[li][r], alone[li][r % len(cases)]), (li, r)


def test_layers_share_the_engines_scratch():
    """Every layer on the process's engine forwards in one workspace (the queue runs them one
    at a time), so a second layer's forward as large as the first's adds no scratch: one per
    layer would hold it times the model's layers."""
    a, b = (make(layer_idx=20 + j, method="AMXINT8", chunk=512) for j in range(2))
    for w, seed in [(a, 51), (b, 52)]:
        w.load_weights_from_tensors(*experts(E, H, I, seed=seed))
    x = np.random.default_rng(6).standard_normal((300, H)).astype(np.float32)
    ids, ws = routing(300, K, E, 6)
    a.forward(x, ids, ws)
    held = a.cpu_infer.scratch_bytes
    assert held > 300 * H * 4, held
    b.forward(x, ids, ws)
    assert b.cpu_infer.scratch_bytes == held
