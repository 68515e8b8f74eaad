"""Layerwise prefill's host buffers (KT's ``submit_write_weight_scale_to_buffer``): each expert
written per GPU rank in the GPU layer's layout and the checkpoint's own encoding (MXFP4's e8m0
scales as the bf16 buffers the fork stages them in, MXFP8's as their codes), checked byte for byte against slices of
the tensors the checkpoint file holds."""

import numpy as np
import pytest

from conftest import bf16_bits, make, write_config, write_safetensors

E, H, I = 4, 256, 256


def name(e, proj, suffix):
    return f"model.layers.0.mlp.experts.{e}.{proj}_proj.{suffix}"


def checkpoint(tmp_path, kind, seed=3):
    """A one-layer checkpoint of `kind`; returns, per expert and projection (gate, up, down),
    (weights as a byte matrix [rows, row bytes], scales as a matrix of their dtype or None)."""
    r = np.random.default_rng(seed)
    tensors, want = {}, {}
    for e in range(E):
        for proj, (n, k) in zip(["gate", "up", "down"], [(I, H), (I, H), (H, I)]):
            if kind in ("bf16", "f32"):
                # bf16 tensors are copied; f32 ones are written as bf16 (rounded to nearest).
                w = (r.standard_normal((n, k)) * 0.05).astype(np.float32)
                bits = bf16_bits(w)
                if kind == "bf16":
                    tensors[name(e, proj, "weight")] = ("BF16", (n, k), bits.tobytes())
                else:
                    tensors[name(e, proj, "weight")] = ("F32", (n, k), w.tobytes())
                want[e, proj] = (bits.view(np.uint8).reshape(n, 2 * k), None)
            elif kind == "mxfp8":
                # The KT fork's MiniMax-M3 layout: e4m3 weights, e8m0 codes per 32 columns, copied.
                codes = r.integers(0, 256, (n, k), dtype=np.uint8)
                codes[(codes & 0x7F) == 0x7F] = 0x3C  # no NaN codes
                tensors[name(e, proj, "weight")] = ("F8_E4M3", (n, k), codes.tobytes())
                s = r.integers(110, 131, (n, k // 32), dtype=np.uint8)
                tensors[name(e, proj, "weight_scale_inv")] = ("F8_E8M0", (n, k // 32), s.tobytes())
                want[e, proj] = (codes, s)
            elif kind.startswith("fp8"):
                codes = r.integers(0, 256, (n, k), dtype=np.uint8)
                codes[(codes & 0x7F) == 0x7F] = 0x3C  # no NaN codes
                tensors[name(e, proj, "weight")] = ("F8_E4M3", (n, k), codes.tobytes())
                shape = (n // 128, k // 128) if kind == "fp8-block" else (n,)
                s = (r.random(shape) * 0.01 + 1e-3).astype(np.float32)
                tensors[name(e, proj, "weight_scale_inv")] = ("F32", shape, s.tobytes())
                want[e, proj] = (codes, s)
            elif kind == "mxfp4":
                # DeepSeek-V4-Flash's layout; scales staged as the bf16 of 2^(code - 127).
                packed = r.integers(0, 256, (n, k // 2), dtype=np.uint8)
                codes = r.integers(100, 141, (n, k // 32), dtype=np.uint8)
                codes[:, 0] = 0  # 2^-127, a subnormal
                stem = f"layers.0.ffn.experts.{e}.{ {'gate': 'w1', 'up': 'w3', 'down': 'w2'}[proj]}"
                tensors[f"{stem}.weight"] = ("I8", (n, k // 2), packed.tobytes())
                tensors[f"{stem}.scale"] = ("F8_E8M0", (n, k // 32), codes.tobytes())
                want[e, proj] = (packed, np.where(codes == 0, 0x40, codes.astype(np.uint16) << 7).astype(np.uint16))
            else:
                packed = r.integers(0, 256, (n, k // 2), dtype=np.uint8)
                tensors[name(e, proj, "weight_packed")] = ("I32", (n, k // 8), packed.tobytes())
                s = bf16_bits(r.random((n, k // 32)).astype(np.float32) * 0.02 + 1e-3)
                tensors[name(e, proj, "weight_scale")] = ("BF16", (n, k // 32), s.tobytes())
                want[e, proj] = (packed, s)
    write_safetensors(tmp_path / "model.safetensors", tensors)
    write_config(tmp_path, E, 2, H, I, 1)
    return want


def expected(want, e, tp, kind):
    """Each rank's (w13, w13 scales, w2, w2 scales) bytes as the module docs lay them out."""
    part = I // tp
    (g, gs), (u, us), (d, ds) = want[e, "gate"], want[e, "up"], want[e, "down"]
    out = []
    for r in range(tp):
        # A down row's bytes per element: d.shape[1] / I (bf16 2, fp8 1, int4 ½).
        rows, cols = slice(r * part, (r + 1) * part), slice(r * part * d.shape[1] // I, (r + 1) * part * d.shape[1] // I)
        w13 = np.concatenate([g[rows], u[rows]]).tobytes()
        w2 = np.ascontiguousarray(d[:, cols]).tobytes()
        if kind in ("bf16", "f32"):
            s13 = s2 = b""
        elif kind == "fp8-block":
            b = slice(r * part // 128, (r + 1) * part // 128)
            s13, s2 = np.concatenate([gs[b], us[b]]).tobytes(), np.ascontiguousarray(ds[:, b]).tobytes()
        elif kind == "fp8-row":
            s13, s2 = np.concatenate([gs[rows], us[rows]]).tobytes(), ds.tobytes()
        else:
            b = slice(r * part // 32, (r + 1) * part // 32)
            s13, s2 = np.concatenate([gs[rows], us[rows]]).tobytes(), np.ascontiguousarray(ds[:, b]).tobytes()
        out.append((w13, s13, w2, s2))
    return out


METHODS = {"bf16": "BF16", "f32": "BF16", "fp8-block": "FP8", "fp8-row": "FP8_PERCHANNEL", "int4": "RAWINT4",
           "mxfp4": "MXFP4", "mxfp8": "MXFP8"}


@pytest.mark.parametrize("kind", list(METHODS))
@pytest.mark.parametrize("tp", [1, 2])
def test_every_expert_is_written_per_gpu_rank_as_the_checkpoint_holds_it(tmp_path, kind, tp):
    want = checkpoint(tmp_path, kind)
    moe = make(e=E, h=H, i=I, method=METHODS[kind], path=str(tmp_path))
    slot_map = np.array([2, 0, 3, 1])  # slot p holds logical expert slot_map[p]
    moe.load_weights(slot_map)
    for slot in range(E):
        exp = expected(want, int(slot_map[slot]), tp, kind)
        bufs = [[np.full(max(len(b), 1), 0xEE, np.uint8) for b in rank] for rank in exp]
        ptrs = [[bufs[r][j].ctypes.data if exp[r][j] else 0 for r in range(tp)] for j in range(4)]
        moe.submit_write_weight_scale_to_buffer(tp, slot, ptrs[0], ptrs[1], ptrs[2], ptrs[3])
        moe.sync_write_weight_scale_to_buffer()
        for r in range(tp):
            for j, what in enumerate(["w13", "w13 scales", "w2", "w2 scales"]):
                n = len(exp[r][j])
                assert bufs[r][j][:n].tobytes() == exp[r][j], f"{kind} tp={tp} slot {slot} rank {r}: {what}"
    moe.sync_write_weight_scale_to_buffer()  # nothing submitted: returns at once, as KT's


def test_layerwise_writes_refuse_what_they_cannot_do(tmp_path):
    checkpoint(tmp_path, "fp8-block")
    moe = make(e=E, h=H, i=I, method="FP8", path=str(tmp_path))
    buf = np.zeros(4 * I * H, np.uint8)
    p = buf.ctypes.data
    with pytest.raises(RuntimeError, match="load_weights"):
        moe.submit_write_weight_scale_to_buffer(1, 0, [p], [p], [p], [p])
        moe.sync_write_weight_scale_to_buffer()
    moe.load_weights()
    with pytest.raises(ValueError, match="w2_weight_ptrs has 1 addresses, expected gpu_tp_count = 2"):
        moe.submit_write_weight_scale_to_buffer(2, 0, [p, p], [p, p], [p], [p, p])
    # 256 intermediate rows do not split into 128-row scale blocks for 4 ranks.
    moe.submit_write_weight_scale_to_buffer(4, 0, [p] * 4, [p] * 4, [p] * 4, [p] * 4)
    with pytest.raises(ValueError, match="parts of a multiple of 128"):
        moe.sync_write_weight_scale_to_buffer()
    moe.submit_write_weight_scale_to_buffer(1, 0, [p], [0], [p], [p])
    with pytest.raises(ValueError, match="scale pointer is 0"):
        moe.sync_write_weight_scale_to_buffer()
    moe.submit_write_weight_scale_to_buffer(1, E, [p], [p], [p], [p])
    with pytest.raises(ValueError, match="expert_id 4 is not a slot"):
        moe.sync_write_weight_scale_to_buffer()
    moe.submit_write_weight_scale_to_buffer(1, 0, [p], [p], [p], [p])
    with pytest.raises(RuntimeError, match="already submitted"):
        moe.submit_write_weight_scale_to_buffer(1, 0, [p], [p], [p], [p])
    moe.sync_write_weight_scale_to_buffer()
    tensors = make(e=E, h=H, i=I, method="FP8")
    z = np.zeros((E, I, H), np.float32)
    tensors.load_weights_from_tensors(z, z, np.zeros((E, H, I), np.float32))
    tensors.submit_write_weight_scale_to_buffer(1, 0, [p], [p], [p], [p])
    with pytest.raises(RuntimeError, match="from a Hugging Face safetensors checkpoint"):
        tensors.sync_write_weight_scale_to_buffer()
