"""kt_kernel.sft with numpy alone: LoRA on every projection, forward and backward against a
numpy textbook in float64, finite differences of the Rust forward, the inference forward's bits
with LoRA B zero, gradient accumulation and scaling, the cache stack and the errors."""

import numpy as np
import pytest
from conftest import e4m3_values, experts, silu

from kt_kernel import KTMoEWrapper
from kt_kernel.sft import SFTMoEWrapper

E, K, H, I, R, ALPHA = 8, 2, 256, 128, 4, 8.0


def bf16_bits(x):
    """float32 -> bf16 bits (uint16), rounding to nearest even."""
    b = np.ascontiguousarray(x, dtype=np.float32).view(np.uint32)
    return ((b + 0x7FFF + ((b >> 16) & 1)) >> 16).astype(np.uint16)


def from_bits(b):
    return (b.astype(np.uint32) << 16).view(np.float32)


def lora(seed, zero_b=False):
    r = np.random.default_rng(seed)
    shapes = [(E, R, H), (E, I, R), (E, R, H), (E, I, R), (E, R, I), (E, H, R)]
    return [bf16_bits(np.zeros(s) if (zero_b and n % 2) else 0.1 * r.standard_normal(s)) for n, s in enumerate(shapes)]


def wrapper(method="AMXBF16_SFT", depth=1, mode="sft", path=None, layer_idx=0, rank=R, full=False, bwd=None):
    kw = dict(
        layer_idx=layer_idx, num_experts=E, num_experts_per_tok=K, hidden_size=H, moe_intermediate_size=I,
        cpuinfer_threads=2, threadpool_count=2, weight_path=path, chunked_prefill_size=64, method=method,
        lora_rank=rank, lora_alpha=ALPHA, max_cache_depth=depth, full_weight_grad=full,
    )
    if bwd is None:
        return KTMoEWrapper(mode=mode, **kw)
    # backward_weights is ours: SFTMoEWrapper's (KTMoEWrapper keeps KT's signature).
    return SFTMoEWrapper(backward_weights=bwd, **kw)


def layer(method="AMXBF16_SFT", depth=1, seed=1, zero_b=False):
    """A loaded wrapper, its bf16-rounded base weights, LoRA matrices and zeroed gradients."""
    w = wrapper(method, depth)
    gate, up, down = experts(E, H, I, seed)
    # bf16 weights, so the textbook and the layer see the same values (method AMXBF16_SFT).
    gate, up, down = (from_bits(bf16_bits(m)) for m in (gate, up, down))
    w.load_weights_from_tensors(gate, up, down)
    mats = lora(seed + 1, zero_b)
    grads = [np.zeros_like(m) for m in mats]
    w.init_lora_weights(*mats, *grads)
    return w, (gate, up, down), mats, grads


def inputs(n, seed):
    r = np.random.default_rng(seed)
    x = from_bits(bf16_bits(r.standard_normal((n, H))))
    ids = np.stack([r.choice(E, K, replace=False) for _ in range(n)]).astype(np.int64)
    wts = r.uniform(0.1, 1.0, (n, K)).astype(np.float32)
    return x, ids, wts


def textbook(x, ids, wts, base, mats, go, base_grads=None):
    """float64 forward and backward: out, grad_input, grad_weights, dot scales, LoRA grads (and
    the base weights' gradients added into ``base_grads``, gate/up/down, when given)."""
    gate, up, down = (m.astype(np.float64) for m in base)
    ga, gb, ua, ub, da, db = (from_bits(m).astype(np.float64) for m in mats)
    s = ALPHA / R
    n = x.shape[0]
    out, gi, gw, scale = np.zeros((n, H)), np.zeros((n, H)), np.zeros((n, K)), np.zeros((n, K))
    gl = [np.zeros(m.shape) for m in mats]
    for t in range(n):
        xt = x[t].astype(np.float64)
        for j in range(K):
            e, wt = int(ids[t, j]), float(wts[t, j])
            axg, axu = ga[e] @ xt, ua[e] @ xt
            g = gate[e] @ xt + s * gb[e] @ axg
            u = up[e] @ xt + s * ub[e] @ axu
            h = silu(g) * u
            ah = da[e] @ h
            y = down[e] @ h + s * db[e] @ ah
            out[t] += wt * y
            gw[t, j] = go[t] @ y
            scale[t, j] = np.linalg.norm(go[t]) * np.linalg.norm(y) / np.sqrt(H)
            gy = wt * go[t]
            bgy = db[e].T @ gy
            gl[5][e] += s * np.outer(gy, ah)
            gl[4][e] += s * np.outer(bgy, h)
            dh = down[e].T @ gy + s * da[e].T @ bgy
            sig = 1 / (1 + np.exp(-g))
            dg, du = dh * u * sig * (1 + g * (1 - sig)), dh * silu(g)
            bdg, bdu = gb[e].T @ dg, ub[e].T @ du
            gl[1][e] += s * np.outer(dg, axg)
            gl[0][e] += s * np.outer(bdg, xt)
            gl[3][e] += s * np.outer(du, axu)
            gl[2][e] += s * np.outer(bdu, xt)
            if base_grads is not None:
                base_grads[0][e] += np.outer(dg, xt)
                base_grads[1][e] += np.outer(du, xt)
                base_grads[2][e] += np.outer(gy, h)
            gi[t] += gate[e].T @ dg + up[e].T @ du + s * (ga[e].T @ bdg + ua[e].T @ bdu)
    return out, gi, gw, scale, gl


def rel(a, b):
    return float(np.abs(np.asarray(a, np.float64) - b).sum() / max(np.abs(b).sum(), 1e-30))


@pytest.mark.parametrize("method, tol", [("AMXBF16_SFT", 2e-2), ("AMXINT8_SFT", 3e-2)])
def test_forward_and_backward_match_the_textbook(method, tol):
    w, base, mats, grads = layer(method)
    if method != "AMXBF16_SFT":
        # The layer quantized the weights: compare with what it multiplies by.
        base = tuple(dequantized(method, m) for m in base)
    x, ids, wts = inputs(7, 3)
    out = w.forward(x, ids, wts)
    go = from_bits(bf16_bits(np.random.default_rng(4).standard_normal((7, H)))).astype(np.float64)
    ref_out, ref_gi, ref_gw, scale, ref_gl = textbook(x, ids, wts, base, mats, go)
    assert rel(out, ref_out) < (1e-2 if method == "AMXBF16_SFT" else 3e-2)
    assert w.cache_bytes > 0
    gi, gw = w.backward(go.astype(np.float32))
    assert w.cache_bytes == 0
    assert rel(gi, ref_gi) < tol
    assert np.abs(gw - ref_gw).sum() / scale.sum() < tol
    for name, g, ref in zip(["gate_a", "gate_b", "up_a", "up_b", "down_a", "down_b"], grads, ref_gl):
        assert rel(from_bits(g), ref) < tol, name


def dequantized(method, m):
    """What an INT8 layer multiplies by: symmetric per-row int8 (KT's AMXINT8)."""
    assert method == "AMXINT8_SFT"
    flat = m.reshape(-1, m.shape[-1]).astype(np.float32)
    d = np.abs(flat).max(axis=1, keepdims=True) / 127.0
    q = np.clip(np.round(flat / np.where(d == 0, 1, d)), -127, 127)
    return (q * d).reshape(m.shape)


def test_lora_b_zero_gives_the_inference_forward_bits():
    w, base, _, _ = layer(zero_b=True)
    inf = wrapper("BF16", mode="inference")
    inf.load_weights_from_tensors(*base)
    x, ids, wts = inputs(9, 5)
    assert np.array_equal(w.forward(x, ids, wts, save_for_backward=False), np.asarray(inf.forward(x, ids, wts)))


def test_finite_differences_of_the_rust_forward():
    """``⟨G, out⟩`` as the routing weights and one LoRA B entry move, against the backward."""
    w, _, mats, grads = layer()
    x, ids, wts = inputs(5, 6)
    go = np.random.default_rng(7).standard_normal((5, H)).astype(np.float32)
    w.forward(x, ids, wts)
    _, gw = w.backward(go)
    loss = lambda v: float((w.forward(x, ids, v, save_for_backward=False).astype(np.float64) * go).sum())
    for t, j in [(0, 0), (2, 1), (4, 0)]:
        eps = 0.25
        up, down = wts.copy(), wts.copy()
        up[t, j] += eps
        down[t, j] -= eps
        fd = (loss(up) - loss(down)) / (2 * eps)
        assert abs(fd - gw[t, j]) < 0.05 * (abs(gw[t, j]) + np.abs(go[t]).mean()), (t, j, fd, gw[t, j])
    # A LoRA B entry of down (expert ids[0, 0], output row 3, rank 1): exact bf16 steps.
    e, b = int(ids[0, 0]), mats[5]
    g_before = from_bits(grads[5][e, 3, 1]).item()
    w.forward(x, ids, wts)
    w.backward(go)
    analytic = from_bits(grads[5][e, 3, 1]).item() - g_before
    v0 = b[e, 3, 1:2].copy()
    vals = []
    for step in (1, -1):
        b[e, 3, 1:2] = bf16_bits(from_bits(v0) + step * 0.5)
        vals.append(loss(wts))
    b[e, 3, 1:2] = v0
    fd = (vals[0] - vals[1]) / 1.0
    assert abs(fd - analytic) < 0.05 * abs(analytic) + 0.05, (fd, analytic)


def test_gradients_accumulate_and_scale():
    w, _, _, grads = layer()
    x, ids, wts = inputs(6, 8)
    go = np.random.default_rng(9).standard_normal((6, H)).astype(np.float32)
    w.forward(x, ids, wts)
    w.backward(go)
    once = [from_bits(g).copy() for g in grads]
    w.forward(x, ids, wts)
    w.backward(go, optimizer_grad_scale=0.5)
    for a, g in zip(once, grads):
        # bf16 accumulation: 1.5x within its rounding.
        assert np.allclose(from_bits(g), 1.5 * a, rtol=2e-2, atol=1e-3 * np.abs(a).max())


def test_saved_forwards_form_a_stack_of_max_cache_depth():
    w, _, _, _ = layer(depth=2)
    x3, ids3, w3 = inputs(3, 1)
    x5, ids5, w5 = inputs(5, 2)
    with pytest.raises(RuntimeError, match="No forward cache"):
        w.backward(np.zeros((3, H), np.float32))
    w.forward(x3, ids3, w3)
    w.forward(x5, ids5, w5)
    with pytest.raises(RuntimeError, match="max_cache_depth = 2"):
        w.forward(x3, ids3, w3)
    gi5, _ = w.backward(np.ones((5, H), np.float32))  # the newest first
    gi3, gw3 = w.backward(np.ones((3, H), np.float32))
    assert gi5.shape == (5, H) and gi3.shape == (3, H) and gw3.shape == (3, K)


def test_errors_name_what_is_wrong():
    w = wrapper()
    x, ids, wts = inputs(2, 1)
    with pytest.raises(RuntimeError, match="load_weights"):
        w.forward(x, ids, wts)
    gate, up, down = experts(E, H, I, 1)
    w.load_weights_from_tensors(gate, up, down)
    with pytest.raises(RuntimeError, match="init_lora_weights"):
        w.forward(x, ids, wts)
    mats = lora(2)
    bad = list(mats)
    bad[1] = np.zeros((E, I, R + 1), np.uint16)
    with pytest.raises(ValueError, match=r"gate_lora_b must have shape \[8, 128, 4\]"):
        w.init_lora_weights(*bad, *[np.zeros_like(m) for m in mats])
    with pytest.raises(TypeError, match="bf16"):
        w.init_lora_weights(*[m.astype(np.float32) for m in mats], *[np.zeros_like(m) for m in mats])
    with pytest.raises(NotImplementedError, match="AMXINT4_1_SFT"):
        wrapper("AMXINT4_1_SFT")
    with pytest.raises(ValueError, match="chunked_prefill_size"):
        w.init_lora_weights(*mats, *[np.zeros_like(m) for m in mats])
        w.forward(*inputs(65, 1))


def test_full_weight_gradients_match_the_textbook_accumulate_and_update_the_layer():
    """Full fine-tuning with LoRA: the base weights' gradients against the textbook's, added to
    (times optimizer_grad_scale) by a second backward; an optimizer step on the base
    parameters and ``update_base_weights`` give the forward of a layer loaded with the new
    weights, bit for bit."""
    w = wrapper(full=True)
    gate, up, down = (from_bits(bf16_bits(m)) for m in experts(E, H, I, 11))
    w.load_weights_from_tensors(gate, up, down)
    mats = lora(12)
    grads = [np.zeros_like(m) for m in mats]
    w.init_lora_weights(*mats, *grads)
    w.init_full_weight_grad_buffers(gate, up, down)
    assert [b.shape for b in (w.gate_proj_buf, w.grad_up_proj_buf, w.grad_down_proj_buf)] == [(E, I, H), (E, I, H), (E, H, I)]
    x, ids, wts = inputs(7, 13)
    go = from_bits(bf16_bits(np.random.default_rng(14).standard_normal((7, H))))
    ref = [np.zeros((E, I, H)), np.zeros((E, I, H)), np.zeros((E, H, I))]
    textbook(x, ids, wts, (gate, up, down), mats, go.astype(np.float64), ref)
    w.forward(x, ids, wts)
    w.backward(go)
    bufs = [w.grad_gate_proj_buf, w.grad_up_proj_buf, w.grad_down_proj_buf]
    once = [from_bits(b).copy() for b in bufs]
    for name, got, want in zip(["gate", "up", "down"], once, ref):
        assert rel(got, want) < 2e-2, name
    w.forward(x, ids, wts)
    w.backward(go, optimizer_grad_scale=0.5)
    for a, b in zip(once, bufs):
        assert np.allclose(from_bits(b), 1.5 * a, rtol=2e-2, atol=1e-3 * np.abs(a).max())

    # A step on the base, then the layer runs the new weights.
    for p, g in zip([w.gate_proj_buf, w.up_proj_buf, w.down_proj_buf], bufs):
        p[...] = bf16_bits(from_bits(p) - 0.01 * from_bits(g))
    w.update_base_weights()
    fresh = wrapper(full=True)
    fresh.load_weights_from_tensors(*(from_bits(p) for p in (w.gate_proj_buf, w.up_proj_buf, w.down_proj_buf)))
    fresh.init_lora_weights(*mats, *[np.zeros_like(m) for m in mats])
    new = w.forward(x, ids, wts, save_for_backward=False)
    assert np.array_equal(new, fresh.forward(x, ids, wts, save_for_backward=False))
    old = wrapper()
    old.load_weights_from_tensors(gate, up, down)
    old.init_lora_weights(*mats, *[np.zeros_like(m) for m in mats])
    assert not np.array_equal(new, old.forward(x, ids, wts, save_for_backward=False))


def test_full_fine_tuning_without_lora():
    """Rank 0 with full_weight_grad: no LoRA to register, the inference forward's bits, the
    base gradients of the plain MoE; the mistakes KT refuses are refused."""
    w = wrapper(rank=0, full=True)
    gate, up, down = (from_bits(bf16_bits(m)) for m in experts(E, H, I, 21))
    w.load_weights_from_tensors(gate, up, down)
    w.init_full_weight_grad_buffers(gate, up, down)
    inf = wrapper("BF16", mode="inference")
    inf.load_weights_from_tensors(gate, up, down)
    x, ids, wts = inputs(5, 22)
    assert np.array_equal(w.forward(x, ids, wts), np.asarray(inf.forward(x, ids, wts)))
    go = from_bits(bf16_bits(np.random.default_rng(23).standard_normal((5, H))))
    w.backward(go)
    zero = [np.zeros_like(m) for m in lora(1)]
    ref = [np.zeros((E, I, H)), np.zeros((E, I, H)), np.zeros((E, H, I))]
    textbook(x, ids, wts, (gate, up, down), zero, go.astype(np.float64), ref)
    for name, b, want in zip(["gate", "up", "down"], [w.grad_gate_proj_buf, w.grad_up_proj_buf, w.grad_down_proj_buf], ref):
        assert rel(from_bits(b), want) < 2e-2, name
    with pytest.raises(ValueError, match="full_weight_grad=True"):
        wrapper(rank=0)
    with pytest.raises(RuntimeError, match="full_weight_grad=True"):
        wrapper().init_full_weight_grad_buffers(gate, up, down)
    with pytest.raises(ValueError, match="frozen-base LoRA only"):
        wrapper("AMXFP8_SFT", full=True)
    with pytest.raises(ValueError, match=r"down_proj must have shape \[8, 256, 128\]"):
        w.init_full_weight_grad_buffers(gate, up, gate)
    with pytest.raises(RuntimeError, match="init_full_weight_grad_buffers"):
        w2 = wrapper(full=True)
        w2.load_weights_from_tensors(gate, up, down)
        w2.update_base_weights()


def test_skip_lora_runs_the_base_alone():
    w = wrapper("AMXBF16_SFT_SkipLoRA")
    gate, up, down = experts(E, H, I, 1)
    w.load_weights_from_tensors(gate, up, down)
    inf = wrapper("BF16", mode="inference")
    inf.load_weights_from_tensors(gate, up, down)
    x, ids, wts = inputs(4, 3)
    assert np.array_equal(w.forward(x, ids, wts), np.asarray(inf.forward(x, ids, wts)))
    gi, gw = w.backward(np.ones((4, H), np.float32))
    assert np.isfinite(gi).all() and np.abs(gw).sum() > 0


def test_load_weights_reads_a_hugging_face_checkpoint(tmp_path):
    """A checkpoint written by the safetensors package, and its `kt convert` outputs, through a
    slot map: the same steps as the same tensors loaded directly; mismatches are refused."""
    from safetensors.numpy import save_file

    from conftest import write_config

    g, u, d = (a.astype(np.float16) for a in experts(E, H, I, 21))
    names = lambda e: [f"model.layers.2.mlp.experts.{e}.{p}_proj.weight" for p in ("gate", "up", "down")]
    save_file({n: m for e in range(E) for n, m in zip(names(e), (g[e], u[e], d[e]))}, str(tmp_path / "model.safetensors"))
    write_config(tmp_path, E, K, H, I, 3)
    m = np.roll(np.arange(E, dtype=np.int64), 3)
    mats = lora(4)

    def step(w):
        """`w` loaded (from its files, or from the tensors), then one forward and backward."""
        if w.weight_path:
            w.load_weights(m)
        else:
            w.load_weights_from_tensors(g, u, d, m)
        w.init_lora_weights(*mats, *[np.zeros_like(x) for x in mats])
        x, ids, wts = inputs(6, 5)
        return (w.forward(x, ids, wts), *w.backward(np.ones((6, H), np.float32)))

    for a, b in zip(step(wrapper(path=str(tmp_path), layer_idx=2)), step(wrapper())):
        assert np.array_equal(a, b)

    # Converted files (`kt convert`, KT's AMXINT8_SFT / AMXINT4_SFT input) for the pool's two
    # parts: the same steps as quantizing the tensors online; files for another part count are
    # refused naming both counts.
    from kt_kernel import kt_kernel_ext as ext

    # (int4's KT packing wants 128 columns a part: tested from Rust on a wider layer.)
    for method, kt in [("int8", "AMXINT8_SFT")]:
        out = tmp_path / f"converted-{method}"
        ext.convert(str(tmp_path), str(out), method, 2, 2)
        steps = [step(w) for w in (wrapper(kt, path=str(out), layer_idx=2), wrapper(kt))]
        for a, b in zip(*steps):
            assert np.array_equal(a, b), method
    # With the backward's transposes in the files (`kt convert --backward`, KT's
    # ffn_*_bwd_exps) and backward_weights="method" (KT's int8 transposes, half of bf16's
    # bytes): the same steps as making those transposes from the tensors.
    out = tmp_path / "converted-bwd"
    ext.convert(str(tmp_path), str(out), "int8", 2, 2, True)
    pair = (wrapper("AMXINT8_SFT", path=str(out), layer_idx=2, bwd="method"), wrapper("AMXINT8_SFT", bwd="method"))
    steps = [step(w) for w in pair]
    sizes = [w.moe.weight_bytes for w in pair]
    for a, b in zip(*steps):
        assert np.array_equal(a, b)
    exact = wrapper("AMXINT8_SFT", path=str(out), layer_idx=2)
    exact.load_weights(m)
    assert sizes[0] == sizes[1] < exact.moe.weight_bytes
    with pytest.raises(ValueError, match="backward_weights"):
        wrapper("AMXINT8_SFT", bwd="int3")
    ext.convert(str(tmp_path), str(tmp_path / "one-part"), "int8", 1, 2)
    with pytest.raises(ValueError, match=r"1 NUMA part\(s\).*2 requested"):
        wrapper("AMXINT8_SFT", path=str(tmp_path / "one-part"), layer_idx=2).load_weights(m)
    with pytest.raises(FileNotFoundError, match="does not exist"):
        wrapper(path=str(tmp_path / "missing")).load_weights()
    with pytest.raises(ValueError, match="weight_path is None"):
        wrapper().load_weights()


def rawint4(seed, zero_b=False):
    """A compressed-tensors int4 layer (groups of 32, q in [-7, 7] with a ±7 in every group, so
    quantizing its values again gives the same nibbles): its RAWINT4ExpertWeights (numpy) and
    its values."""
    from kt_kernel.sft import RAWINT4ExpertWeights

    r = np.random.default_rng(seed)
    parts, values = [], []
    for rows, cols in [(I, H), (I, H), (H, I)]:
        q = r.integers(-7, 8, (E, rows, cols))
        q[..., ::32] = 7 * r.choice([-1, 1], (E, rows, cols // 32))
        s = from_bits(bf16_bits(r.uniform(0.005, 0.02, (E, rows, cols // 32))))
        nib = (q + 8).astype(np.uint8)
        parts += [nib[..., 0::2] | (nib[..., 1::2] << 4), bf16_bits(s)]
        values.append((q * np.repeat(s, 32, axis=-1)).astype(np.float32))
    return RAWINT4ExpertWeights(*parts), values


def test_rawint4_weights_load_as_stored():
    """RAWINT4_SFT takes a compressed-tensors model's nibbles and scales as they are: the same
    steps, bit for bit, as quantizing their values (which requantize exactly here) into int4
    groups of 32; mistakes are refused naming the tensor."""
    raw, values = rawint4(31)
    m = np.roll(np.arange(E, dtype=np.int64), 2)
    mats = lora(32)
    steps = []
    for w in (wrapper("RAWINT4_SFT"), KTMoEWrapper(
            layer_idx=0, num_experts=E, num_experts_per_tok=K, hidden_size=H, moe_intermediate_size=I,
            cpuinfer_threads=2, threadpool_count=2, weight_path=None, chunked_prefill_size=64,
            method="AMXINT4_KGroup_SFT", group_size=32, mode="sft", lora_rank=R, lora_alpha=ALPHA)):
        if w.method == "RAWINT4_SFT":
            w.load_rawint4_weights(raw, m)
        else:
            w.load_weights_from_tensors(*values, m)
        w.init_lora_weights(*mats, *[np.zeros_like(x) for x in mats])
        x, ids, wts = inputs(5, 33)
        steps.append((w.forward(x, ids, wts), *w.backward(np.ones((5, H), np.float32))))
    for a, b in zip(*steps):
        assert np.array_equal(a, b)
    with pytest.raises(ValueError, match="needs method RAWINT4_SFT"):
        wrapper().load_rawint4_weights(raw)
    bad, _ = rawint4(34)
    bad.down_scale = bad.down_scale[:, :, :-1]
    with pytest.raises(ValueError, match=r"down_scale must have shape \[8, 256, 4\]"):
        wrapper("RAWINT4_SFT").load_rawint4_weights(bad)


def test_block_fp8_weights_load_as_stored():
    """AMXFP8_SFT takes an FP8 model's e4m3 bytes and block scales as they are (KT's
    BlockFP8ExpertWeights: lists per expert): the same steps, bit for bit, as quantizing their
    values, which requantize exactly here (power-of-two scales, a ±448 in every block). I is
    256 here: the pool's two NUMA parts take whole 128-column blocks."""
    from kt_kernel.sft import BlockFP8ExpertWeights

    i2 = 256
    r = np.random.default_rng(41)
    lists, values = [], []
    for rows, cols in [(i2, H), (i2, H), (H, i2)]:
        w, s, v = [], [], []
        for _ in range(E):
            codes = r.integers(0, 0x7F, (rows, cols)).astype(np.uint8) | (r.integers(0, 2, (rows, cols)) << 7).astype(np.uint8)
            codes[::128, ::128] = 0x7E  # 448
            scale = (2.0 ** r.integers(-12, -8, (rows // 128, cols // 128))).astype(np.float32)
            w.append(codes)
            s.append(scale)
            v.append(e4m3_values(codes) * np.repeat(np.repeat(scale, 128, 0), 128, 1))
        lists += [w, s]
        values.append(np.stack(v))
    fp8 = BlockFP8ExpertWeights(*lists)
    shapes = [(E, R, H), (E, i2, R), (E, R, H), (E, i2, R), (E, R, i2), (E, H, R)]
    mats = [bf16_bits(0.1 * r.standard_normal(sh)) for sh in shapes]
    fp8_wrapper = lambda: SFTMoEWrapper(
        0, E, K, H, i2, cpuinfer_threads=2, threadpool_count=2, chunked_prefill_size=64, lora_rank=R,
        lora_alpha=ALPHA, method="AMXFP8_SFT")
    steps = []
    for stored in (True, False):
        w = fp8_wrapper()
        if stored:
            w.load_block_fp8_weights(fp8)
        else:
            w.load_weights_from_tensors(*values)
        w.init_lora_weights(*mats, *[np.zeros_like(x) for x in mats])
        x, ids, wts = inputs(6, 43)
        steps.append((w.forward(x, ids, wts), *w.backward(np.ones((6, H), np.float32))))
    for a, b in zip(*steps):
        assert np.array_equal(a, b)
    with pytest.raises(ValueError, match="needs method AMXFP8_SFT"):
        wrapper("RAWINT4_SFT").load_block_fp8_weights(fp8)
    fp8.up_scale = fp8.up_scale[:-1]
    with pytest.raises(ValueError, match="up: expected 8 experts"):
        fp8_wrapper().load_block_fp8_weights(fp8)


def test_gpu_experts_are_left_to_the_gpu():
    """Experts on the GPU (a mask, or upstream's num_gpu_experts): the CPU layer's output,
    input gradient and LoRA gradients are the textbook's over the other slots, the GPU slots'
    routing-weight gradients are 0, and the mask is read live (updated in place)."""
    mask = np.zeros(E, dtype=bool)
    mask[[1, 4]] = True
    gate, up, down = (from_bits(bf16_bits(m)) for m in experts(E, H, I, 51))
    mats = lora(52)
    x, ids, wts = inputs(9, 53)
    go = from_bits(bf16_bits(np.random.default_rng(54).standard_normal((9, H)))).astype(np.float64)
    on_cpu = ~mask[ids]
    ref_out, ref_gi, ref_gw, scale, ref_gl = textbook(x, ids, wts * on_cpu, (gate, up, down), mats, go)
    w = KTMoEWrapper(layer_idx=0, num_experts=E, num_experts_per_tok=K, hidden_size=H, moe_intermediate_size=I,
                     gpu_experts_mask=mask, cpuinfer_threads=2, threadpool_count=2, weight_path=None,
                     chunked_prefill_size=64, method="AMXBF16_SFT", mode="sft", lora_rank=R, lora_alpha=ALPHA)
    assert w.num_gpu_experts == 2
    w.load_weights_from_tensors(gate, up, down)
    grads = [np.zeros_like(m) for m in mats]
    w.init_lora_weights(*mats, *grads)
    assert rel(w.forward(x, ids, wts), ref_out) < 1e-2
    gi, gw = w.backward(go.astype(np.float32))
    assert rel(gi, ref_gi) < 2e-2
    assert np.all(gw[~on_cpu] == 0) and np.abs(gw - ref_gw)[on_cpu].sum() / scale[on_cpu].sum() < 2e-2
    for name, g, ref in zip(["gate_a", "gate_b", "up_a", "up_b", "down_a", "down_b"], grads, ref_gl):
        assert rel(from_bits(g), ref) < 2e-2, name
        assert not from_bits(g)[mask].any(), name  # the GPU experts' LoRA is the GPU's to train
    # The mask is read live, and num_gpu_experts puts experts 0..n-1 on the GPU.
    w.gpu_experts_mask[:] = False
    all_cpu, _, _, _, _ = textbook(x, ids, wts, (gate, up, down), mats, go)
    assert rel(w.forward(x, ids, wts, save_for_backward=False), all_cpu) < 1e-2
    first = KTMoEWrapper(layer_idx=0, num_experts=E, num_experts_per_tok=K, hidden_size=H, moe_intermediate_size=I,
                         num_gpu_experts=3, cpuinfer_threads=2, threadpool_count=2, weight_path=None,
                         chunked_prefill_size=64, method="AMXBF16_SFT", mode="sft", lora_rank=R, lora_alpha=ALPHA)
    assert first.gpu_experts_mask.tolist() == [True] * 3 + [False] * (E - 3)


def mxfp4_layer(seed):
    """An MXFP4 layer: per projection (gate, up, down) its packed e2m1 bytes (the even column
    low) and e8m0 scale codes, ``[E, rows, cols/2]`` and ``[E, rows, cols/32]``, and its values."""
    fp4 = np.array([0, 0.5, 1, 1.5, 2, 3, 4, 6, -0.0, -0.5, -1, -1.5, -2, -3, -4, -6], np.float32)
    r = np.random.default_rng(seed)
    packed, codes, values = [], [], []
    for rows, cols in [(I, H), (I, H), (H, I)]:
        c = r.integers(0, 16, (E, rows, cols)).astype(np.uint8)
        c[..., ::32] = 7  # 6.0
        x = r.integers(121, 125, (E, rows, cols // 32)).astype(np.uint8)  # 2^-6 .. 2^-3
        packed.append(c[..., 0::2] | (c[..., 1::2] << 4))
        codes.append(x)
        values.append(fp4[c] * np.repeat(2.0 ** (x.astype(np.float32) - 127), 32, axis=-1))
    return packed, codes, values


def test_mxfp4_weights_with_the_swiglu_limit(tmp_path):
    """MXFP4_SFT with gpt-oss's clamped SwiGLU (swiglu_limit): B zero gives the MXFP4 inference
    wrapper's bits with the same limit; the e2m1 nibbles and power-of-two scales load as stored,
    from KT's load_mxfp4_weights lists or from a DeepSeek-V4-Flash checkpoint (`load_weights`:
    `layers.L.ffn.experts.e.{w1,w3,w2}.{weight,scale}`), the same steps, bit for bit, as
    quantizing their values (MXFP4 requantizes exactly)."""
    from safetensors.numpy import save_file

    packed, codes, values = mxfp4_layer(61)
    data = {}
    for name, p, x in zip(("gate", "up", "down"), packed, codes):
        data[name] = list(p)
        data[f"{name}_scale"] = list(bf16_bits(2.0 ** (x.astype(np.float32) - 127)))
    save_file({f"layers.2.ffn.experts.{e}.{w}.{what}": (p[e].view(np.int8) if what == "weight" else x[e])
               for w, p, x in zip(("w1", "w3", "w2"), packed, codes) for e in range(E) for what in ("weight", "scale")},
              str(tmp_path / "model.safetensors"))
    limit = 1.0  # below many of these layers' gate and up values: the clamp holds for a share of them
    kw = dict(layer_idx=2, num_experts=E, num_experts_per_tok=K, hidden_size=H, moe_intermediate_size=I,
              cpuinfer_threads=2, threadpool_count=2, chunked_prefill_size=64, swiglu_limit=limit)
    zero, mats = lora(62, zero_b=True), lora(63)
    x, ids, wts = inputs(7, 64)
    want = None
    for path in (None, str(tmp_path)):
        inf = KTMoEWrapper(method="MXFP4", weight_path=path, **kw)
        inf.load_weights() if path else inf.load_weights_from_tensors(*values)
        out = np.asarray(inf.forward(x, ids, wts))
        assert want is None or np.array_equal(out, want), "the checkpoint's layer differs from its values'"
        want = out
    w = KTMoEWrapper(method="MXFP4_SFT", mode="sft", lora_rank=R, lora_alpha=ALPHA, weight_path=None, **kw)
    w.load_mxfp4_weights(data)
    w.init_lora_weights(*zero, *[np.zeros_like(m) for m in zero])
    assert np.array_equal(w.forward(x, ids, wts, save_for_backward=False), want)
    steps = []
    for how in ("lists", "tensors", "checkpoint"):
        w = KTMoEWrapper(method="MXFP4_SFT", mode="sft", lora_rank=R, lora_alpha=ALPHA,
                         weight_path=str(tmp_path) if how == "checkpoint" else None, **kw)
        {"lists": lambda: w.load_mxfp4_weights(data), "tensors": lambda: w.load_weights_from_tensors(*values),
         "checkpoint": lambda: w.load_weights()}[how]()
        w.init_lora_weights(*mats, *[np.zeros_like(m) for m in mats])
        steps.append((w.forward(x, ids, wts), *w.backward(np.ones((7, H), np.float32))))
    for other in steps[1:]:
        for a, b in zip(steps[0], other):
            assert np.array_equal(a, b)
    with pytest.raises(ValueError, match="needs method MXFP4_SFT"):
        wrapper().load_mxfp4_weights(data)
