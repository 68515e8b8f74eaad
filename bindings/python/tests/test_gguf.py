"""GGUF models written with the ``gguf`` package (gguf-py): every supported type's
dequantization bit-exact against ``gguf.quants.dequantize`` (MXFP4's every scale code among
random bytes); MoE layers run with method
LLAMAFILE against an fp32 MoE on the dequantized weights, with mixed types per projection and
split files; bad files give clear errors."""

import numpy as np
import pytest

gguf = pytest.importorskip("gguf")
from gguf import GGMLQuantizationType as Q  # noqa: E402

from conftest import bf16_bits, make, moe_reference, rel_err, routing  # noqa: E402
from kt_kernel import kt_kernel_ext as ext  # noqa: E402

LATTICE = ["IQ1_S", "IQ1_M", "IQ2_XXS", "IQ2_XS", "IQ2_S", "IQ3_XXS", "IQ3_S"]
TYPES = ["F32", "F16", "BF16", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K", "IQ4_NL", "IQ4_XS", "MXFP4"] + LATTICE
# Byte offsets of each block's f16 scales (d, then m / dmin); IQ1_M's d is spread over the top
# nibbles of the bytes at IQ1M_D.
SCALES = {"Q4_1": [0, 2], "Q5_1": [0, 2], "Q4_K": [0, 2], "Q5_K": [0, 2], "Q2_K": [80, 82], "Q3_K": [108], "Q6_K": [208], "IQ1_M": [], "MXFP4": []}
IQ1M_D = [49, 51, 53, 55]
# Typical |level x sub-scale| and the offset (in units of d) that centres the levels.
TYPICAL = {"Q4_0": 8, "Q4_1": 8, "Q5_0": 8, "Q5_1": 8, "Q8_0": 64, "IQ4_NL": 64, "MXFP4": 4.5, "IQ4_XS": 1024, "Q6_K": 2048, "Q2_K": 16, "Q3_K": 64, "Q4_K": 256, "Q5_K": 256}
TYPICAL |= {"IQ1_S": 6, "IQ1_M": 6, "IQ2_XXS": 50, "IQ2_XS": 50, "IQ2_S": 50, "IQ3_XXS": 132, "IQ3_S": 128}
CENTRE = {"Q4_1": -7.5, "Q5_1": -15.5, "Q2_K": 1.5, "Q4_K": 7.5, "Q5_K": 15.5}
ARCH = "qwen3moe"


def random_tensor(name, shape, rng, centred=False):
    """Raw bytes of a random valid tensor of type ``name`` with element shape ``shape``: floats
    are Gaussian; quantized types are random bytes with finite random scales (gguf-py cannot
    quantize K-quants or IQ types); ``centred`` makes the levels average to zero, as trained
    weights do, so a MoE on them is well conditioned."""
    cols = shape[-1]
    std = 1.0 / np.sqrt(cols)
    if name in ("F32", "F16", "BF16"):
        x = (rng.standard_normal(shape) * std).astype(np.float32)
        return {"F32": x, "F16": x.astype(np.float16), "BF16": bf16_bits(x)}[name].view(np.uint8).reshape(*shape[:-1], -1)
    qt = Q[name]
    blk, size = gguf.GGML_QUANT_SIZES[qt]
    nb = int(np.prod(shape)) // blk
    raw = rng.integers(0, 256, size=(nb, size), dtype=np.uint8)
    if centred and name == "Q2_K":
        raw[:, :16] = (raw[:, :16] & 0xF) * 0x11
    if centred and name in ("Q4_K", "Q5_K"):
        sc = rng.integers(0, 64, size=(nb, 8), dtype=np.uint8)
        lo = sc[:, :4] | ((sc[:, 4:] >> 4) << 6)
        raw[:, 4:8], raw[:, 8:12], raw[:, 12:16] = lo, lo, (sc[:, 4:] & 0xF) * 0x11
    d = (std / TYPICAL[name] * (0.5 + rng.random(nb))).astype(np.float32)
    offs = SCALES.get(name, [0])
    vals = [d, d * CENTRE.get(name, 0.0) if centred else d * (rng.random(nb) - 0.5)]
    for off, v in zip(offs, vals):
        raw[:, off : off + 2] = v.astype(np.float16).view(np.uint8).reshape(nb, 2)
    if name == "MXFP4" and centred:
        raw[:, 0] = 128 + np.round(np.log2(d)).astype(np.uint8)  # e8m0: 2^(e - 128) nearest d
    if name == "IQ1_M":
        bits = d.astype(np.float16).view(np.uint16)
        for k, at in enumerate(IQ1M_D):
            raw[:, at] = (raw[:, at] & 0x0F) | (((bits >> (4 * k)) & 0xF) << 4).astype(np.uint8)
    return raw.reshape(*shape[:-1], cols // blk * size)


def write(path, tensors, meta=None, **writer_args):
    """A GGUF file (arch qwen3moe) of ``{name: (type name, raw bytes)}`` and ``meta``."""
    w = gguf.GGUFWriter(str(path), ARCH, **writer_args)
    for k, v in (meta or {}).items():
        w.add_uint32(k, v)
    for n, (t, raw) in tensors.items():
        w.add_tensor(n, raw, raw_dtype=Q[t])  # uint8 rows: gguf-py derives the element shape
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def deq(name, raw):
    with np.errstate(over="ignore"):  # MXFP4's largest scale codes overflow to inf, as in ggml
        return gguf.quants.dequantize(raw, Q[name]).astype(np.float32)


@pytest.mark.parametrize("name", TYPES)
def test_dequantization_is_bit_exact_with_gguf_py(tmp_path, name):
    rng = np.random.default_rng(TYPES.index(name))
    shapes = [(3, 512), (5, 256), (2, 2, 768)]
    if name in LATTICE:
        shapes.append((128, 2048))  # 32 768 lookups: each entry of the 2048-entry grid all but surely
    tensors = {f"t.{name}.{i}": (name, random_tensor(name, shape, rng)) for i, shape in enumerate(shapes)}
    if name == "MXFP4":
        # Every e8m0 scale code, subnormal halves (0, 1) and 2^127 (255) among them.
        raw = random_tensor(name, (8, 1024), rng).reshape(256, 17)
        raw[:, 0] = np.arange(256)
        tensors["t.MXFP4.codes"] = (name, raw.reshape(8, -1))
    path = tmp_path / "t.gguf"
    write(path, tensors)
    for n, (t, raw) in tensors.items():
        shape, data = ext.gguf_dequantize(str(path), n)
        got = np.frombuffer(data, dtype=np.float32).reshape(shape)
        want = deq(t, raw)
        assert got.shape == want.shape
        assert np.array_equal(got.view(np.uint32), want.view(np.uint32)), f"{n}: {np.abs(got - want).max()}"


E, K, H, I = 8, 2, 256, 512


def moe_meta(e=E, k=K, h=H, i=I, blocks=2):
    return {f"{ARCH}.expert_count": e, f"{ARCH}.expert_used_count": k, f"{ARCH}.embedding_length": h, f"{ARCH}.expert_feed_forward_length": i, f"{ARCH}.block_count": blocks}


def moe_tensors(types, layer, rng, e=E, h=H, i=I):
    """Layer ``layer``'s stacked experts, gate/up [E, I, H] and down [E, H, I] of ``types``; the
    quantizable legacy types are quantized from Gaussians with gguf-py, the rest random."""
    out = {}
    for proj, t, shape in zip(("gate", "up", "down"), types, [(e, i, h), (e, i, h), (e, h, i)]):
        if t in ("Q4_0", "Q8_0", "MXFP4"):
            x = (rng.standard_normal(shape) / np.sqrt(shape[-1])).astype(np.float32)
            raw = gguf.quants.quantize(x, Q[t])
        else:
            raw = random_tensor(t, shape, rng, centred=True)
        out[f"blk.{layer}.ffn_{proj}_exps.weight"] = (t, raw)
    return out


MIXES = [("Q4_K", "Q4_K", "Q6_K"), ("Q8_0", "Q8_0", "Q8_0"), ("Q4_0", "IQ4_NL", "Q5_K"), ("IQ4_XS", "Q3_K", "Q8_0"), ("F16", "BF16", "Q2_K"), ("Q5_0", "Q5_1", "Q4_1")]
MIXES += [("IQ1_S", "IQ1_M", "IQ2_XXS"), ("IQ2_XS", "IQ2_S", "IQ3_XXS"), ("IQ2_XXS", "IQ2_XXS", "IQ3_S"), ("MXFP4", "MXFP4", "MXFP4")]


@pytest.mark.parametrize("types", MIXES, ids=["-".join(m) for m in MIXES])
def test_llamafile_layer_matches_fp32_moe_on_the_dequantized_weights(tmp_path, types):
    rng = np.random.default_rng(7)
    tensors = moe_tensors(types, 1, rng)  # layer 0 is dense (no experts)
    path = tmp_path / "m.gguf"
    write(path, tensors, moe_meta())
    g, u, d = (deq(t, tensors[f"blk.1.ffn_{p}_exps.weight"][1]) for p, t in zip(("gate", "up", "down"), types))
    mask = np.zeros(E, bool)
    mask[5] = True
    w = make(layer_idx=1, method="LLAMAFILE", path=str(path), mask=mask)
    m = np.roll(np.arange(E, dtype=np.int64), 2)
    w.load_weights(m)
    for n in (1, 7, 33):
        x = rng.standard_normal((n, H)).astype(np.float32)
        ids, ws = routing(n, K, E, n, invalid=True)
        out = w.forward(x, ids, ws)
        ref = moe_reference(x, ids, ws, g, u, d, mask=mask, slot_to_logical=m)
        assert rel_err(out, ref) < 0.03, (types, n, rel_err(out, ref))


def test_split_files_and_directories_load_the_same_layer(tmp_path):
    rng = np.random.default_rng(3)
    tensors = moe_tensors(("Q4_K", "Q4_K", "Q6_K"), 0, rng)
    one = tmp_path / "one"
    split = tmp_path / "split"
    one.mkdir()
    split.mkdir()
    write(one / "m.gguf", tensors, moe_meta(blocks=1))
    write(split / "m.gguf", tensors, moe_meta(blocks=1), split_max_tensors=1)
    parts = sorted(p.name for p in split.iterdir())
    assert parts == ["m-00001-of-00003.gguf", "m-00002-of-00003.gguf", "m-00003-of-00003.gguf"]
    x = rng.standard_normal((5, H)).astype(np.float32)
    ids, ws = routing(5, K, E, 1)
    outs = []
    for p in (one / "m.gguf", split / parts[1], split):
        w = make(layer_idx=0, method="LLAMAFILE", path=str(p))
        w.load_weights(np.arange(E, dtype=np.int64))
        outs.append(w.forward(x, ids, ws))
    assert np.array_equal(outs[0], outs[1]) and np.array_equal(outs[0], outs[2])


def load_error(path, layer=0, **kw):
    w = make(layer_idx=layer, method="LLAMAFILE", path=str(path), **kw)
    with pytest.raises((ValueError, FileNotFoundError)) as e:
        w.load_weights(np.arange(kw.get("e", E), dtype=np.int64))
    return str(e.value)


def test_bad_files_are_clear_errors(tmp_path):
    rng = np.random.default_rng(11)
    good = tmp_path / "good.gguf"
    write(good, moe_tensors(("Q4_K", "Q4_K", "Q6_K"), 0, rng), moe_meta(blocks=1))
    data = good.read_bytes()
    # Truncated: the last tensor's data is cut.
    trunc = tmp_path / "trunc.gguf"
    trunc.write_bytes(data[: len(data) - 1000])
    assert "beyond the end of the file" in load_error(trunc)
    # Cut inside the header.
    head = tmp_path / "head.gguf"
    head.write_bytes(data[:40])
    assert "truncated" in load_error(head)
    # Not GGUF at all.
    junk = tmp_path / "junk.gguf"
    junk.write_bytes(b"PK\x03\x04" + bytes(100))
    assert "not a GGUF file" in load_error(junk)
    # A layer without experts.
    assert "blk.3.ffn_gate_exps.weight" in load_error(good, layer=3)
    # Shapes that do not match the layer asked for (from the metadata or the wrapper).
    assert "shape" in load_error(good, i=256)
    # An unsupported type, named.
    t = moe_tensors(("Q4_K", "Q4_K", "Q6_K"), 0, rng)
    raw = rng.integers(0, 256, size=(E, I, H // 256 * 66), dtype=np.uint8)  # tq2_0: 66 bytes / 256
    t["blk.0.ffn_up_exps.weight"] = ("TQ2_0", raw)
    bad = tmp_path / "tq2.gguf"
    write(bad, t, moe_meta(blocks=1))
    msg = load_error(bad)
    assert "tq2_0" in msg and "blk.0.ffn_up_exps.weight" in msg
    # gpt-oss's expert biases, refused rather than left out.
    t = moe_tensors(("MXFP4", "MXFP4", "MXFP4"), 0, rng)
    t["blk.0.ffn_up_exps.bias"] = ("F32", rng.standard_normal((E, I)).astype(np.float32).view(np.uint8))
    biased = tmp_path / "biased.gguf"
    write(biased, t, moe_meta(blocks=1))
    msg = load_error(biased)
    assert "blk.0.ffn_up_exps.bias" in msg and "biases" in msg
    # A tensor offset past the end of the file (patched in the tensor-info table).
    off = data.index(b"blk.0.ffn_down_exps.weight") + len("blk.0.ffn_down_exps.weight") + 4 + 3 * 8 + 4
    patched = bytearray(data)
    patched[off : off + 8] = (1 << 40).to_bytes(8, "little")
    far = tmp_path / "far.gguf"
    far.write_bytes(bytes(patched))
    assert "beyond the end of the file" in load_error(far)
    # A GGUF path given to another method, and LLAMAFILE from tensors.
    w = make(layer_idx=0, method="BF16", path=str(good))
    with pytest.raises(ValueError, match="LLAMAFILE"):
        w.load_weights(np.arange(E, dtype=np.int64))
    w = make(layer_idx=0, method="LLAMAFILE")
    with pytest.raises(ValueError, match="GGUF"):
        w.load_weights_from_tensors(*(np.zeros(s, np.float32) for s in [(E, I, H), (E, I, H), (E, H, I)]))


def hf_checkpoint(d, rng, layers=2, moe_from=1):
    """A small f32 Hugging Face checkpoint (deepseek names), experts in layers >= moe_from."""
    from safetensors.numpy import save_file

    from conftest import write_config

    tensors, weights = {}, {}
    for layer in range(moe_from, layers):
        g, u, dn = ((rng.standard_normal(s) / np.sqrt(s[-1])).astype(np.float32) for s in [(E, I, H), (E, I, H), (E, H, I)])
        weights[layer] = (g, u, dn)
        for e in range(E):
            for p, m in zip(("gate", "up", "down"), (g[e], u[e], dn[e])):
                tensors[f"model.layers.{layer}.mlp.experts.{e}.{p}_proj.weight"] = m
    tensors["model.embed_tokens.weight"] = np.zeros((4, H), np.float32)
    save_file(tensors, str(d / "model.safetensors"))
    write_config(d, E, K, H, I, layers)
    return weights


@pytest.mark.parametrize("method, qt", [("q4_0", "Q4_0"), ("q8_0", "Q8_0")])
def test_convert_quantizes_legacy_types_byte_for_byte_as_gguf_py(tmp_path, method, qt):
    src, out = tmp_path / "hf", tmp_path / "gguf"
    src.mkdir()
    weights = hf_checkpoint(src, np.random.default_rng(1))
    assert ext.convert(str(src), str(out), method=method) == (1, 0)
    r = gguf.GGUFReader(str(out / "model-00001-of-00001.gguf"))
    got = {t.name: t for t in r.tensors}
    for p, w in zip(("gate", "up", "down"), weights[1]):
        t = got[f"blk.1.ffn_{p}_exps.weight"]
        assert t.tensor_type == Q[qt] and list(reversed(t.shape.tolist())) == list(w.shape)
        assert np.array_equal(np.asarray(t.data).reshape(-1), gguf.quants.quantize(w, Q[qt]).reshape(-1))


def test_convert_to_q4_k_runs_with_llamafile_and_resumes(tmp_path):
    src, out = tmp_path / "hf", tmp_path / "gguf"
    src.mkdir()
    weights = hf_checkpoint(src, np.random.default_rng(2), layers=3)
    assert ext.convert(str(src), str(out), method="q4_k") == (2, 0)
    files = sorted(p.name for p in out.iterdir())
    assert files == ["model-00001-of-00002.gguf", "model-00002-of-00002.gguf"]
    r = gguf.GGUFReader(str(out / files[1]))
    t = {t.name: t for t in r.tensors}["blk.2.ffn_down_exps.weight"]
    assert t.tensor_type == Q.Q4_K
    # gguf-py reads our Q4_K back to within 4-bit precision of the original weights.
    back = gguf.quants.dequantize(np.asarray(t.data), Q.Q4_K).reshape(E, H, I)
    assert rel_err(back, weights[2][2].astype(np.float64)) < 0.12
    w = make(layer_idx=2, method="LLAMAFILE", path=str(out))
    w.load_weights(np.arange(E, dtype=np.int64))
    rng = np.random.default_rng(3)
    x = rng.standard_normal((6, H)).astype(np.float32)
    ids, ws = routing(6, K, E, 4)
    assert rel_err(w.forward(x, ids, ws), moe_reference(x, ids, ws, *weights[2])) < 0.15
    # A rerun keeps both complete files.
    before = [(out / f).stat().st_mtime_ns for f in files]
    assert ext.convert(str(src), str(out), method="q4_k") == (0, 2)
    assert [(out / f).stat().st_mtime_ns for f in files] == before
    with pytest.raises(ValueError, match="cannot be quantized"):
        ext.convert(str(src), str(tmp_path / "q6"), method="q6_k")
