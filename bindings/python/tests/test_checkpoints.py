"""``load_weights`` from Hugging Face checkpoints written with the ``safetensors`` package (and
by hand for bfloat16, which its numpy API lacks): layouts, shards, dtypes, errors."""

import json

import numpy as np
import pytest
from safetensors.numpy import save_file

from conftest import (
    LIMITS, e4m3_values, experts, glu, make, moe_reference, rel_err, routing, write_bf16_safetensors, write_config,
    write_safetensors,
)

E, K, H, I = 8, 2, 256, 512


def deepseek_names(layer, e):
    return [f"model.layers.{layer}.mlp.experts.{e}.{p}_proj.weight" for p in ("gate", "up", "down")]


def mixtral_names(layer, e):
    return [f"model.layers.{layer}.block_sparse_moe.experts.{e}.{w}.weight" for w in ("w1", "w3", "w2")]


@pytest.mark.parametrize("method", ["BF16", "AMXINT8", "FP8"])
def test_f16_deepseek_checkpoint_equals_loading_the_same_tensors(tmp_path, method):
    g, u, d = (a.astype(np.float16) for a in experts(E, H, I, seed=21))
    tensors = {}
    for e in range(E):
        for name, m in zip(deepseek_names(3, e), (g[e], u[e], d[e])):
            tensors[name] = m
    tensors["model.embed_tokens.weight"] = np.zeros((4, H), np.float16)
    save_file(tensors, str(tmp_path / "model.safetensors"))
    write_config(tmp_path, E, K, H, I, 4)
    m = np.roll(np.arange(E, dtype=np.int64), 3)
    from_ckpt = make(layer_idx=3, method=method, path=str(tmp_path))
    from_ckpt.load_weights(m)
    direct = make(layer_idx=3, method=method)
    direct.load_weights_from_tensors(g, u, d, m)
    x = np.random.default_rng(1).standard_normal((9, H)).astype(np.float32)
    ids, ws = routing(9, K, E, 2)
    a, b = from_ckpt.forward(x, ids, ws), direct.forward(x, ids, ws)
    assert np.array_equal(a, b)
    ref = moe_reference(x, ids, ws, *(t.astype(np.float32) for t in (g, u, d)), slot_to_logical=m)
    assert rel_err(a, ref) < LIMITS[method]


@pytest.mark.parametrize("source", ["checkpoint", "tensors"])
def test_skip_gpu_experts_leaves_them_out_of_cpu_memory(tmp_path, monkeypatch, source):
    """KT_KERNEL_SKIP_GPU_EXPERTS=1: the slots the mask puts on the GPU at load are neither read
    nor packed (the layer's bytes shrink by their share), the CPU's results are the bits of a
    layer holding every expert, and a mask later moving one of them to the CPU is an error at
    the sync naming the variable, after which the layer still works."""
    g, u, d = experts(E, H, I, seed=31)
    tensors = {n: w for e in range(E) for n, w in zip(deepseek_names(0, e), (g[e], u[e], d[e]))}
    write_bf16_safetensors(tmp_path / "model.safetensors", tensors)
    write_config(tmp_path, E, K, H, I, 1)
    m = np.roll(np.arange(E, dtype=np.int64), 2)
    mask = np.isin(np.arange(E), [0, 5])

    def loaded():
        w = make(method="AMXINT8", mask=mask, path=str(tmp_path))
        w.load_weights(m) if source == "checkpoint" else w.load_weights_from_tensors(g, u, d, m)
        return w

    every = loaded()
    monkeypatch.setenv("KT_KERNEL_SKIP_GPU_EXPERTS", "1")
    cpu_only = loaded()
    assert cpu_only.moe.bytes * E == every.moe.bytes * (E - 2) > 0
    x = np.random.default_rng(4).standard_normal((6, H)).astype(np.float32)
    ids, ws = routing(6, K, E, 4)
    ids[0, 0] = 0
    assert np.array_equal(cpu_only.forward(x, ids, ws), every.forward(x, ids, ws))
    cpu_only.gpu_experts_mask[0] = False
    with pytest.raises(RuntimeError, match="slot 0 .*KT_KERNEL_SKIP_GPU_EXPERTS=1"):
        cpu_only.forward(x, ids, ws)
    cpu_only.gpu_experts_mask[0] = True
    assert np.array_equal(cpu_only.forward(x, ids, ws), every.forward(x, ids, ws))
    monkeypatch.setenv("KT_KERNEL_SKIP_GPU_EXPERTS", "yes")
    with pytest.raises(ValueError, match="KT_KERNEL_SKIP_GPU_EXPERTS must be 0 or 1, got 'yes'"):
        make(method="AMXINT8", mask=mask)


def test_sharded_bf16_mixtral_checkpoint_with_index(tmp_path):
    g, u, d = experts(E, H, I, seed=5)
    shards = [{}, {}]
    weight_map = {}
    for e in range(E):
        for name, m in zip(mixtral_names(0, e), (g[e], u[e], d[e])):
            f = f"model-0000{e % 2 + 1}-of-00002.safetensors"
            shards[e % 2][name] = m
            weight_map[name] = f
    for i, s in enumerate(shards):
        write_bf16_safetensors(tmp_path / f"model-0000{i + 1}-of-00002.safetensors", s)
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    write_config(tmp_path, E, K, H, I, 1)
    w = make(layer_idx=0, method="BF16", path=str(tmp_path))
    w.load_weights(np.arange(E, dtype=np.int64))
    x = np.random.default_rng(3).standard_normal((5, H)).astype(np.float32)
    ids, ws = routing(5, K, E, 4)
    assert rel_err(w.forward(x, ids, ws), moe_reference(x, ids, ws, g, u, d)) < 0.01


def test_bad_checkpoints_raise_clear_errors(tmp_path):
    g, u, d = (a.astype(np.float16) for a in experts(E, H, I, seed=6))
    tensors = {}
    for e in range(E - 1):  # expert 7 missing
        for name, m in zip(deepseek_names(0, e), (g[e], u[e], d[e])):
            tensors[name] = m
    save_file(tensors, str(tmp_path / "model.safetensors"))
    w = make(layer_idx=0, method="BF16", path=str(tmp_path))
    with pytest.raises(ValueError, match="experts.7.gate_proj.weight is missing"):
        w.load_weights()
    w5 = make(layer_idx=5, method="BF16", path=str(tmp_path))
    with pytest.raises(ValueError, match="layer 5: no MoE expert tensors"):
        w5.load_weights()
    wide = make(layer_idx=0, method="BF16", path=str(tmp_path), h=128)
    with pytest.raises(ValueError, match=r"shape \[512, 256\], expected \[512, 128\]"):
        wide.load_weights()
    kt = tmp_path / "kt"
    kt.mkdir()
    save_file({"blk.0.ffn_up_exps.0.numa.0.weight": np.zeros(16, np.int8)}, str(kt / "model.safetensors"))
    with pytest.raises(ValueError, match="converted for 1 NUMA part"):
        make(layer_idx=0, method="AMXINT8", path=str(kt)).load_weights()
    (tmp_path / "junk").mkdir()
    (tmp_path / "junk" / "model.safetensors").write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{not json}")
    with pytest.raises(ValueError, match="not a valid file"):
        make(layer_idx=0, method="BF16", path=str(tmp_path / "junk")).load_weights()


@pytest.mark.parametrize("method", ["AMXINT8", "AMXINT4", "RAWINT4", "BF16", "FP8"])
def test_converted_checkpoint_loads_like_online_quantization(tmp_path, method):
    from kt_kernel import kt_kernel_ext

    g, u, d = (a.astype(np.float16) for a in experts(E, H, I, seed=31))
    tensors = {name: m for e in range(E) for name, m in zip(deepseek_names(0, e), (g[e], u[e], d[e]))}
    tensors["model.norm.weight"] = np.ones(H, np.float16)
    src, out = tmp_path / "hf", tmp_path / "kt"
    src.mkdir()
    save_file(tensors, str(src / "model.safetensors"))
    write_config(src, E, K, H, I, 1)
    assert kt_kernel_ext.convert(str(src), str(out), method, 2, 2) == (1, 0)
    assert kt_kernel_ext.convert(str(src), str(out), method, 2, 2) == (0, 1), "a rerun resumes: nothing to do"
    converted = make(layer_idx=0, method=method, path=str(out))
    converted.load_weights(np.arange(E, dtype=np.int64))
    online = make(layer_idx=0, method=method)
    online.load_weights_from_tensors(g, u, d)
    x = np.random.default_rng(8).standard_normal((6, H)).astype(np.float32)
    ids, ws = routing(6, K, E, 9)
    assert np.array_equal(converted.forward(x, ids, ws), online.forward(x, ids, ws))

    one = tmp_path / "kt1"
    kt_kernel_ext.convert(str(src), str(one), method, 1, 2)
    with pytest.raises(ValueError, match=r"converted for 1 NUMA part\(s\) but 2 requested"):
        make(layer_idx=0, method=method, path=str(one)).load_weights()


@pytest.mark.parametrize("method", ["AMXINT4", "RAWINT4"])
def test_mse_scales_convert_like_online_quantization(tmp_path, method):
    """convert(scales="mse") writes the scales the online search picks, exactly, and files
    other than absmax's."""
    from kt_kernel import kt_kernel_ext

    g, u, d = experts(E, H, I, seed=33)
    tensors = {name: m for e in range(E) for name, m in zip(deepseek_names(0, e), (g[e], u[e], d[e]))}
    src = tmp_path / "hf"
    src.mkdir()
    save_file(tensors, str(src / "model.safetensors"))
    write_config(src, E, K, H, I, 1)
    x = np.random.default_rng(8).standard_normal((6, H)).astype(np.float32)
    ids, ws = routing(6, K, E, 9)
    outs = {}
    for scales in ("absmax", "mse"):
        out = tmp_path / scales
        assert kt_kernel_ext.convert(str(src), str(out), method, 2, 2, False, scales) == (1, 0)
        converted = make(layer_idx=0, method=method, path=str(out))
        converted.load_weights(np.arange(E, dtype=np.int64))
        online = make(layer_idx=0, method=method, scales=scales)
        online.load_weights_from_tensors(g, u, d)
        outs[scales] = converted.forward(x, ids, ws)
        assert np.array_equal(outs[scales], online.forward(x, ids, ws)), scales
    assert not np.array_equal(outs["absmax"], outs["mse"])
    with pytest.raises(ValueError, match="unknown scales"):
        kt_kernel_ext.convert(str(src), str(tmp_path / "x"), method, 2, 2, False, "l2")


def int4_quantize(w, group, levels=7.0):
    """Symmetric 4-bit groups of `group` columns of w [N, K]: f16 scales amax/`levels` (7.5 as
    compressed-tensors computes them), values rounded and clipped to -8..7; returns the
    offset-8 nibbles [N, K], scales [N, K/g] and the dequantized weights."""
    n, k = w.shape
    g = w.reshape(n, k // group, group)
    s = (np.abs(g).max(axis=2) / levels).astype(np.float16).astype(np.float32)
    q = np.clip(np.rint(g / s[:, :, None]), -8, 7).astype(np.int64) + 8
    return q.reshape(n, k), s, ((q - 8) * s[:, :, None]).reshape(n, k).astype(np.float32)


def pack_words(q):
    """Offset-8 nibbles [R, C] as int32 words of 8 along the rows' columns, the low first."""
    r, c = q.shape
    words = np.zeros((r, c // 8), np.uint32)
    for j in range(8):
        words |= q[:, j::8].astype(np.uint32) << (4 * j)
    return words.view(np.int32)


def gptq_pack(w, group, levels=7.0):
    """Symmetric 4-bit GPTQ of w [N, K]: qweight [K/8, N] int32 (low nibble first along K),
    scales [K/g, N] f16; returns them and the dequantized weights."""
    q, s, deq = int4_quantize(w, group, levels)
    return pack_words(q).T.copy(), s.T.astype(np.float16).copy(), deq


def test_gptq_checkpoint_loads_and_unsupported_gptq_is_refused(tmp_path):
    g, u, d = experts(E, H, I, seed=41)
    tensors, deq = {}, [np.zeros_like(g), np.zeros_like(u), np.zeros_like(d)]
    for e in range(E):
        for p, (name, m) in enumerate(zip(("gate", "up", "down"), (g[e], u[e], d[e]))):
            qw, sc, dq = gptq_pack(m, 128)
            stem = f"model.layers.0.mlp.experts.{e}.{name}_proj"
            tensors[f"{stem}.qweight"], tensors[f"{stem}.scales"] = qw, sc
            tensors[f"{stem}.qzeros"] = np.full((m.shape[1] // 128, m.shape[0] // 8), 0x77777777, np.uint32).view(np.int32)
            deq[p][e] = dq
    save_file(tensors, str(tmp_path / "model.safetensors"))
    cfg = {"num_experts": E, "num_experts_per_tok": K, "hidden_size": H, "moe_intermediate_size": I, "num_hidden_layers": 1,
           "quantization_config": {"quant_method": "gptq", "bits": 4, "group_size": 128, "sym": True, "desc_act": False}}
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    x = np.random.default_rng(5).standard_normal((4, H)).astype(np.float32)
    ids, ws = routing(4, K, E, 6)
    for method, limit in [("BF16", 0.01), ("GPTQ_INT4", 0.02)]:
        w = make(layer_idx=0, method=method, path=str(tmp_path))
        w.load_weights()
        assert rel_err(w.forward(x, ids, ws), moe_reference(x, ids, ws, *deq)) < limit, method

    cfg["quantization_config"]["desc_act"] = True
    other = tmp_path / "act"
    other.mkdir()
    (other / "config.json").write_text(json.dumps(cfg))
    save_file(tensors, str(other / "model.safetensors"))
    with pytest.raises(ValueError, match="desc_act=true"):
        make(layer_idx=0, method="BF16", path=str(other)).load_weights()


def test_4bit_checkpoints_load_their_nibbles_and_scales_as_stored(tmp_path):
    """Kimi-K2's compressed-tensors int4 (RAWINT4) and GPTQ (GPTQ_INT4) checkpoints of the same
    values in groups of 32, quantized as compressed-tensors quantizes (scale amax/7.5, levels
    -8..7, so requantizing them to amax/7 would move most of them): each layer takes the
    checkpoint's group and its nibbles and scales as stored, so both give the same outputs bit
    for bit, within activation rounding of the numpy MoE of the values. Converted with the same
    method (``kt convert``), they are written in that group as stored, and load back (with the
    same method) to the same outputs."""
    from kt_kernel import kt_kernel_ext

    g, u, d = experts(E, H, I, seed=43)
    deq = [np.zeros_like(g), np.zeros_like(u), np.zeros_like(d)]
    ct, gq = {}, {}
    for e in range(E):
        for p, (name, m) in enumerate(zip(("gate", "up", "down"), (g[e], u[e], d[e]))):
            q, s, deq[p][e] = int4_quantize(m, 32, 7.5)
            stem = f"model.layers.0.mlp.experts.{e}.{name}_proj"
            ct[f"{stem}.weight_packed"], ct[f"{stem}.weight_scale"] = pack_words(q), s.astype(np.float16)
            gq[f"{stem}.qweight"], gq[f"{stem}.scales"] = pack_words(q).T.copy(), s.T.astype(np.float16).copy()
    scheme = {"type": "int", "num_bits": 4, "strategy": "group", "group_size": 32, "symmetric": True}
    quant = {"RAWINT4": {"quant_method": "compressed-tensors", "format": "pack-quantized",
                         "config_groups": {"group_0": {"weights": scheme, "targets": ["Linear"]}}},
             "GPTQ_INT4": {"quant_method": "gptq", "bits": 4, "group_size": 32, "sym": True, "desc_act": False}}
    x = np.random.default_rng(6).standard_normal((5, H)).astype(np.float32)
    ids, ws = routing(5, K, E, 7)
    outs = {}
    for method, tensors in [("RAWINT4", ct), ("GPTQ_INT4", gq)]:
        (tmp_path / method).mkdir()
        save_file(tensors, str(tmp_path / method / "model.safetensors"))
        cfg = {"num_experts": E, "num_experts_per_tok": K, "hidden_size": H, "moe_intermediate_size": I,
               "num_hidden_layers": 1, "quantization_config": quant[method]}
        (tmp_path / method / "config.json").write_text(json.dumps(cfg))
        w = make(layer_idx=0, method=method, path=str(tmp_path / method))
        w.load_weights()
        outs[method] = w.forward(x, ids, ws)
        converted = tmp_path / f"{method}-converted"
        assert kt_kernel_ext.convert(str(tmp_path / method), str(converted), method, 2, 2) == (1, 0)
        w = make(layer_idx=0, method=method, path=str(converted))
        w.load_weights()
        assert np.array_equal(w.forward(x, ids, ws), outs[method]), method
    assert np.array_equal(outs["RAWINT4"], outs["GPTQ_INT4"])
    assert rel_err(outs["RAWINT4"], moe_reference(x, ids, ws, *deq)) < 0.02


def test_gpt_oss_mxfp4_checkpoint_with_biases(tmp_path):
    """gpt-oss's layout (fused MXFP4 blocks with gate's and up's rows interleaved, expert biases,
    here F32) written by ``safetensors.numpy``, run without torch: against the numpy MoE of its
    decoded values with the biases and the clamped activation."""
    e, k, h, i = 8, 2, 96, 64
    r = np.random.default_rng(5)
    lut = np.array([0, 0.5, 1, 1.5, 2, 3, 4, 6, -0.0, -0.5, -1, -1.5, -2, -3, -4, -6], np.float32)

    def mx(rows, cols):
        b = r.integers(0, 256, (e, rows, cols // 32, 16), dtype=np.uint8)
        s = r.integers(118, 122, (e, rows, cols // 32), dtype=np.uint8)
        v = np.stack([lut[b & 15], lut[b >> 4]], -1).reshape(e, rows, cols // 32, 32)
        return b, s, (v * np.exp2(s.astype(np.float32) - 127)[..., None]).reshape(e, rows, cols)

    (gu_b, gu_s, gu), (d_b, d_s, down) = mx(2 * i, h), mx(h, i)
    gu_bias = (r.standard_normal((e, 2 * i)) * 0.5).astype(np.float32)
    d_bias = (r.standard_normal((e, h)) * 0.1).astype(np.float32)
    p = "model.layers.0.mlp.experts"
    save_file({f"{p}.gate_up_proj_blocks": gu_b, f"{p}.gate_up_proj_scales": gu_s, f"{p}.gate_up_proj_bias": gu_bias,
               f"{p}.down_proj_blocks": d_b, f"{p}.down_proj_scales": d_s, f"{p}.down_proj_bias": d_bias},
              str(tmp_path / "model.safetensors"))
    (tmp_path / "config.json").write_text(json.dumps({"num_local_experts": e, "num_experts_per_tok": k,
                                                      "hidden_size": h, "intermediate_size": i,
                                                      "num_hidden_layers": 1, "swiglu_limit": 7.0}))
    w = make(e=e, k=k, h=h, i=i, method="MXFP4", path=str(tmp_path), limit=7.0, alpha=1.702)
    w.load_weights()
    x = (r.standard_normal((9, h))).astype(np.float32)
    ids, ws = routing(9, k, e, 6)
    ref = np.zeros((9, h))
    for t in range(9):
        for j in range(k):
            ex = int(ids[t, j])
            g = gu[ex, 0::2] @ x[t] + gu_bias[ex, 0::2]
            u = gu[ex, 1::2] @ x[t] + gu_bias[ex, 1::2]
            ref[t] += ws[t, j] * (down[ex] @ glu(g, u, 7.0, 1.702) + d_bias[ex])
    assert rel_err(w.forward(x, ids, ws), ref) < 0.03


def test_mxfp8_checkpoint_loads_exactly(tmp_path):
    """An MXFP8 checkpoint (the KT fork's MiniMax-M3 layout: e4m3 ``weight``, e8m0
    ``weight_scale_inv`` per 32 columns) loaded with method MXFP8 gives the layer of its values
    bit for bit (MXFP8 requantizes them exactly); a scale code 255 (no number) is refused."""
    e, k, h, i = 4, 2, 128, 64
    r = np.random.default_rng(8)
    tensors, values = {}, []
    for p, (rows, cols) in zip(("gate", "up", "down"), [(i, h), (i, h), (h, i)]):
        codes = r.integers(0, 256, (e, rows, cols), dtype=np.uint8)
        codes[(codes & 0x7F) == 0x7F] = 0x3C  # no NaN codes
        s = r.integers(115, 125, (e, rows, cols // 32), dtype=np.uint8)
        values.append(e4m3_values(codes) * np.exp2(s.astype(np.float32) - 127).repeat(32, axis=-1))
        for x in range(e):
            tensors[f"model.layers.0.mlp.experts.{x}.{p}_proj.weight"] = ("F8_E4M3", (rows, cols), codes[x].tobytes())
            tensors[f"model.layers.0.mlp.experts.{x}.{p}_proj.weight_scale_inv"] = ("F8_E8M0", (rows, cols // 32),
                                                                                   s[x].tobytes())
    write_safetensors(tmp_path / "model.safetensors", tensors)
    write_config(tmp_path, e, k, h, i, 1)
    from_file = make(e=e, k=k, h=h, i=i, method="MXFP8", path=str(tmp_path))
    from_file.load_weights()
    direct = make(e=e, k=k, h=h, i=i, method="MXFP8")
    direct.load_weights_from_tensors(*values)
    x = r.standard_normal((6, h)).astype(np.float32)
    ids, ws = routing(6, k, e, 9)
    assert np.array_equal(from_file.forward(x, ids, ws), direct.forward(x, ids, ws))
    tensors["model.layers.0.mlp.experts.1.up_proj.weight_scale_inv"] = ("F8_E8M0", (i, h // 32), b"\xff" * (i * h // 32))
    write_safetensors(tmp_path / "model.safetensors", tensors)
    bad = make(e=e, k=k, h=h, i=i, method="MXFP8", path=str(tmp_path))
    with pytest.raises(ValueError, match="up_proj.weight_scale_inv.*0xff"):
        bad.load_weights()


@pytest.mark.parametrize("method, same_as", [("MOE_INT8", "AMXINT8"), ("MOE_INT4", "AMXINT4")])
def test_moe_kernel_methods_run_the_amx_numerics_and_refuse_kts_files_for_them(tmp_path, method, same_as):
    """KT's MOE_INT8/MOE_INT4 (its AOCL-BLIS and KML kernel) run AMXINT8's/AMXINT4's numerics on
    the best backend: from tensors, from a Hugging Face checkpoint and from a `kt convert` file,
    the bits of the AMX method; a file KT converted for them (no method recorded, the kernel's
    own layout) is refused naming what to do instead."""
    from kt_kernel import kt_kernel_ext

    g, u, d = (a.astype(np.float16) for a in experts(E, H, I, seed=41))
    x = np.random.default_rng(5).standard_normal((7, H)).astype(np.float32)
    ids, ws = routing(7, K, E, 6)
    amx = make(method=same_as)
    amx.load_weights_from_tensors(g, u, d)
    want = amx.forward(x, ids, ws)
    assert rel_err(want, moe_reference(x, ids, ws, *(t.astype(np.float32) for t in (g, u, d)))) < LIMITS[same_as]

    online = make(method=method)
    online.load_weights_from_tensors(g, u, d)
    assert np.array_equal(online.forward(x, ids, ws), want)

    hf = tmp_path / "hf"
    hf.mkdir()
    save_file({n: m for e in range(E) for n, m in zip(deepseek_names(0, e), (g[e], u[e], d[e]))},
              str(hf / "model.safetensors"))
    write_config(hf, E, K, H, I, 1)
    from_hf = make(method=method, path=str(hf))
    from_hf.load_weights(np.arange(E, dtype=np.int64))
    assert np.array_equal(from_hf.forward(x, ids, ws), want)

    ours = tmp_path / "ours"
    assert kt_kernel_ext.convert(str(hf), str(ours), method, 2, 2) == (1, 0)
    converted = make(method=method, path=str(ours))
    converted.load_weights(np.arange(E, dtype=np.int64))
    assert np.array_equal(converted.forward(x, ids, ws), want)

    # KT's converter writes the same keys with no method recorded.
    kts = tmp_path / "kts"
    kts.mkdir()
    save_file({f"blk.0.ffn_{p}_exps.{e}.numa.{n}.weight": np.zeros(H * I // 2, np.int8)
               for p in ("gate", "up", "down") for e in range(E) for n in range(2)}, str(kts / "model.safetensors"))
    with pytest.raises(ValueError, match=rf"converted by KT-Kernel for {method}.*kt convert --method {method} and load that") as e:
        make(method=method, path=str(kts)).load_weights()
    assert type(e.value).__name__ == "KTValueError"
