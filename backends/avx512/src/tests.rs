//! The conformance suite for every sub-variant, and the same bits from every sub-variant where
//! the arithmetic is exact integers.

use kt_core::rng::SplitMix64;
use kt_core::testing::{layer_outputs, Scenario};
use kt_core::{Backend, MoeConfig, QuantMatrix, WeightFormat};

use crate::imp::{BASE, BF16, VBMI, VNNI};
use crate::{pack, Level, AVX512};

mod best {
    kt_core::conformance_suite!(&crate::AVX512);
}
mod bf16 {
    kt_core::conformance_suite!(&crate::imp::BF16);
}
mod vbmi {
    kt_core::conformance_suite!(&crate::imp::VBMI);
}
mod vnni {
    kt_core::conformance_suite!(&crate::imp::VNNI);
}
mod base {
    kt_core::conformance_suite!(&crate::imp::BASE);
}

/// Integer sums are exact, scaled in one order: every sub-variant gives the base's bits, at
/// every token count from one to past two full tiles (all on one expert, or spread with
/// skipped ids).
#[test]
fn int_formats_give_the_same_bits_on_every_sub_variant() {
    let variants: [&'static dyn Backend; 4] = [&BF16, &VBMI, &VNNI, &BASE];
    let runs: Vec<_> = variants.into_iter().filter(|b| b.cpu_support().is_ok()).collect();
    if runs.len() < 2 {
        kt_core::skip_isa!(format!("AVX-512 (it runs {} AVX-512 sub-variants: nothing to compare)", runs.len()));
        return;
    }
    let cfg = MoeConfig { max_tokens: 40, ..MoeConfig::new(4, 2, 160, 96) };
    let formats =
        [WeightFormat::Int8Row, WeightFormat::Int4Row, WeightFormat::Int4Group { group: 32 }, WeightFormat::Mxfp4];
    for f in formats {
        for (tokens, s) in
            [1, 2, 3, 5, 7, 12, 13, 25, 40].into_iter().flat_map(|n| [(n, Scenario::Skewed), (n, Scenario::InvalidIds)])
        {
            let want = layer_outputs(runs[runs.len() - 1], f, &cfg, tokens, s);
            for b in &runs[..runs.len() - 1] {
                let got = layer_outputs(*b, f, &cfg, tokens, s);
                let same = got.iter().zip(&want).all(|(a, b)| a.to_bits() == b.to_bits());
                assert!(same, "{} and {} differ on {f}, {tokens} tokens {s:?}", b.name(), runs[runs.len() - 1].name());
            }
        }
    }
}

/// KT's order across K blocks (3712 columns: one full block of 3584 and a short one; int4
/// 7424): the integer sums are exact and scaled in the reference's order, so every token count
/// of a tile and past it gives the reference's bits.
#[test]
fn kts_order_across_k_blocks_gives_the_references_bits() {
    let Ok(()) = AVX512.cpu_support() else {
        kt_core::skip_isa!("AVX-512F/BW");
        return;
    };
    for (f, h) in [(WeightFormat::Int8Row, 3712), (WeightFormat::Int4Row, 7424)] {
        let cfg = MoeConfig { max_tokens: 30, ..MoeConfig::new(2, 1, h, 128) };
        assert!(pack::kt_order(f, 128, h) && pack::kt_order(f, h, 128));
        for tokens in [1, 5, 13, 30] {
            let want = layer_outputs(&kt_core::reference::REFERENCE, f, &cfg, tokens, Scenario::Skewed);
            for b in [&AVX512 as &'static dyn Backend, &BASE] {
                let got = layer_outputs(b, f, &cfg, tokens, Scenario::Skewed);
                let same = got.iter().zip(&want).all(|(a, b)| a.to_bits() == b.to_bits());
                assert!(same, "{} differs from the reference on {f}, {tokens} tokens", b.name());
            }
        }
    }
}

/// `avx512` reports, under KT's name, a sub-variant this CPU runs, and runs its kernels.
#[test]
fn the_default_runs_the_sub_variant_it_reports() {
    let Ok(()) = AVX512.cpu_support() else {
        kt_core::skip_isa!("AVX-512F/BW");
        return;
    };
    let subs: [&'static dyn Backend; 4] = [&BF16, &VBMI, &VNNI, &BASE];
    let named = subs.into_iter().find(|b| b.name() == AVX512.variant()).expect("a sub-variant's name");
    assert!(named.cpu_support().is_ok(), "{} reported, which this CPU does not run", named.name());
    let cfg = MoeConfig { max_tokens: 9, ..MoeConfig::new(4, 2, 256, 128) };
    for f in WeightFormat::ALL {
        assert_eq!(AVX512.instructions(f), named.instructions(f), "{f}");
        let bits = |b| layer_outputs(b, f, &cfg, 9, Scenario::Random).iter().map(|v| v.to_bits()).collect::<Vec<_>>();
        assert_eq!(bits(&AVX512), bits(named), "{f}");
    }
}

#[test]
fn fp8_tables_give_every_e4m3_value_in_bf16() {
    let t = kt_zmm::kernels::fp8_bf16_bytes();
    for c in 0..127u8 {
        let want = kt_core::dtype::F8E4M3(c).to_f32();
        let bits = u32::from(t[1][usize::from(c)]) << 24 | u32::from(t[0][usize::from(c)]) << 16;
        assert_eq!(f32::from_bits(bits), want, "e4m3 code {c:#04x}");
    }
}

/// KT's packed bytes are taken as they are (the converted-file path): the same panels, scales
/// and row sums as packing the matrix; shapes outside KT's layout are left to `pack`.
#[test]
fn kts_bytes_are_copied_as_they_are() {
    use kt_core::format::kt_packed::to_kt;
    let mut r = SplitMix64::new(4);
    for (f, rows, cols) in
        [(WeightFormat::Int8Row, 64, 3712), (WeightFormat::Int4Row, 96, 256), (WeightFormat::Int8Row, 40, 64)]
    {
        let x: Vec<f32> = (0..rows * cols).map(|_| r.uniform(1.0)).collect();
        let q = QuantMatrix::quantize(f, rows, cols, &x).unwrap();
        let Ok(bytes) = to_kt(&q) else {
            assert!(AVX512.pack_kt(f, rows, cols, &[], q.scales()).is_none(), "{f} {rows}x{cols}");
            continue;
        };
        let got = AVX512.pack_kt(f, rows, cols, &bytes, q.scales()).expect("KT's order").unwrap();
        let (got, want) = (&got.inner::<kt_zmm::Matrix>().w, pack::pack(&q, AVX512.level()));
        assert!(got.kt && got.data.as_slice() == bytes.as_slice() && got.data.as_slice() == want.data.as_slice());
        assert_eq!((&got.scales, &got.bias), (&want.scales, &want.bias), "{f} {rows}x{cols}");
        let short = AVX512.pack_kt(f, rows, cols, &bytes[1..], q.scales()).unwrap().unwrap_err().to_string();
        assert!(short.contains("KT packed weight bytes"), "{short}");
    }
}

/// K-group int4 scales are packed as bf16 bits where every one is a bf16 (our quantizer's,
/// Kimi-K2's), else kept f32 (GPTQ's f16 scales, loaded as stored); the conformance suite
/// runs both kinds against the reference.
#[test]
fn kgroup_scales_pack_as_bf16_only_where_they_are_bf16() {
    let f = WeightFormat::Int4Group { group: 32 };
    for (scale, bf16) in [(0.01f32, false), (f32::from_bits(0.01f32.to_bits() & 0xFFFF_0000), true)] {
        let m = QuantMatrix::from_parts(f, 40, 64, vec![0x3C; 40 * 32], vec![scale; 80]).unwrap();
        let p = pack::pack(&m, Level::Base);
        assert_eq!((p.scales.is_empty(), p.scales16.len()), (bf16, if bf16 { 2 * 2 * 32 } else { 0 }), "{scale}");
        assert_eq!(p.group_scales(32)[7], scale);
    }
}

/// mxfp8's scales fold into the decoded bf16 for the AMX tiles: every e4m3 element times
/// `2^(c − 127)` exactly, for codes at both ends of the range `pack::mx_folds` allows; a code
/// past either end with a nonzero element leaves the matrix unfolded, a zero block's does not.
#[test]
fn mxfp8_scales_fold_into_the_decoded_bf16_exactly() {
    let f = WeightFormat::Mxfp8;
    let (rows, cols, groups) = (32, 64, 2);
    let code = |r: usize, g: usize| [10u8, 127, 246, 100][(r + g) % 4];
    let byte = |r: usize, c: usize| match ((r * cols + c) % 256) as u8 {
        0x7F | 0xFF => 0x7E, // (e4m3's NaN codes)
        b => b,
    };
    let data: Vec<u8> = (0..rows * cols).map(|i| byte(i / cols, i % cols)).collect();
    let scale = |c: u8| f32::from_bits(u32::from(c) << 23);
    let scales: Vec<f32> = (0..rows * groups).map(|i| scale(code(i / groups, i % groups))).collect();
    let m = QuantMatrix::from_parts(f, rows, cols, data.clone(), scales.clone()).unwrap();
    let p = pack::pack(&m, Level::Bf16);
    assert!(p.pairs && p.folds, "codes 10..=246 fold");
    if !(is_x86_feature_detected!("avx512bw") && is_x86_feature_detected!("avx512vbmi")) {
        kt_core::skip_isa!("AVX-512BW or VBMI (the decode)");
    } else {
        let mut tiles = vec![0u8; 2 * 1024];
        for g in 0..groups {
            let dst = tiles.as_mut_ptr();
            let fold = Some((p.codes[g * 32..].as_ptr(), p.code_bias));
            // SAFETY: the features checked above; 8 units of the panel, 1 KB a half of `tiles`,
            // 32 codes.
            unsafe { crate::fp8_tile_rows(p.panel(0).as_ptr(), 8 * g, 8 * g + 8, [dst, dst.add(1024)], fold) };
            for (r, k) in (0..rows).flat_map(|r| (0..32).map(move |k| (r, k))) {
                let (u, j) = (k / 4, k % 4);
                let at = (r / 16) * 1024 + 128 * u + (j / 2) * 64 + 4 * (r % 16) + 2 * (j % 2);
                let got = f32::from_bits(u32::from(u16::from_le_bytes([tiles[at], tiles[at + 1]])) << 16);
                let (c, e) = (32 * g + k, code(r, g));
                let want = kt_core::dtype::F8E4M3(byte(r, c)).to_f32() * scale(e) / scale(127);
                assert_eq!(got.to_bits(), want.to_bits(), "row {r}, column {c}, code {e}");
            }
        }
    }
    for (c, zero_block, folds) in [(9u8, false, false), (247, false, false), (0, true, true), (254, true, true)] {
        let mut data = data.clone();
        let mut scales = scales.clone();
        scales[5 * groups + 1] = scale(c);
        if zero_block {
            data[5 * cols + 32..5 * cols + 64].fill(0x80); // −0
        }
        let p = pack::pack(&QuantMatrix::from_parts(f, rows, cols, data, scales).unwrap(), Level::Bf16);
        assert_eq!((p.codes[32 + 5], p.folds), (c, folds), "code {c}, zero block: {zero_block}");
    }
}

/// MX codes become f32 exponent fields (`Packed::exponents`) wherever that is exact: each
/// nonzero block's scale is `2^(c − bias)` as packed before (the `vscalefps` path's), +∞ past
/// 2^127 included; a subnormal-scaled block keeps the codes unless it is all zeros.
#[test]
fn mx_codes_become_exponents_only_where_exact() {
    let (rows, cols, groups) = (40, 64, 2);
    // Codes 0, 1, 2, 127, 200, 254 over the blocks (each the e8m0 code of its f32 scale).
    let codes: Vec<u8> = (0..rows * groups).map(|i| [2u8, 127, 200, 254, 0, 1][i % 6]).collect();
    let scales: Vec<f32> = codes.iter().map(|&c| f32::from_bits(u32::from(c) << 23)).collect();
    for f in [WeightFormat::Mxfp4, WeightFormat::Mxfp8] {
        let (bytes, minus_zeros) =
            (f.data_bytes(rows, cols) / rows, if f == WeightFormat::Mxfp4 { 0x88 } else { 0x80 });
        let data: Vec<u8> = (0..rows * bytes).map(|i| [0x35, 0x71, 0x12, 0x5E][i % 4]).collect();
        for level in [Level::Bf16, Level::Vnni] {
            // The packed scale is 2^(c − bias): mxfp4's ½ folded in, or mxfp8's 2^120 where
            // its e4m3 decode places bits (no `vdpbf16ps`).
            let bias = match (f, level) {
                (WeightFormat::Mxfp4, _) => 128,
                (_, Level::Bf16) => 127,
                _ => 7,
            };
            let subnormal = |c: u8| i32::from(c) + 127 - bias < 1;
            // Unblanked, then with every block of codes 0 and 1 all −0 (the zero test ignores
            // signs).
            for blanks in [vec![], (0..rows * groups).filter(|&i| codes[i] < 2).collect::<Vec<_>>()] {
                let mut data = data.clone();
                for &at in &blanks {
                    let (r, g) = (at / groups, at % groups);
                    data[r * bytes + g * bytes / groups..r * bytes + (g + 1) * bytes / groups].fill(minus_zeros);
                }
                let m = QuantMatrix::from_parts(f, rows, cols, data, scales.clone()).unwrap();
                let p = pack::pack(&m, level);
                let exact = !codes.iter().enumerate().any(|(i, &c)| subnormal(c) && !blanks.contains(&i));
                assert_eq!(p.exponents, exact, "{f} {level:?} blanks {}", blanks.len());
                for (at, &c) in codes.iter().enumerate().filter(|(at, _)| !blanks.contains(at)) {
                    let (r, g) = (at / groups, at % groups);
                    let got = p.group_scales((r / 32 * groups + g) * 32)[r % 32];
                    let want = pack::mx_scale(c, bias);
                    assert_eq!(got.to_bits(), want.to_bits(), "{f} {level:?} code {c}: {got:e} against {want:e}");
                }
            }
        }
    }
}

/// fp8 panels staged once for a task's token tiles (`kt_zmm`'s `Matrix::stage`) give the bits of
/// tiles that decode as they read (the same call with no scratch to stage in): gate/up and
/// down, every fp8 kind, 17 to 40 tokens (three to five tiles), a partial last panel.
#[test]
fn staged_fp8_panels_give_the_bits_of_decoding_tiles() {
    use kt_core::backend::TaskShape;
    use kt_core::mat::MatMut;
    use kt_core::swiglu::Glu;
    use kt_core::{bf16, LayerFormat};
    kt_core::skip_unless_runs!(&BF16);
    let (rows, cols) = (72, 384);
    let mut r = SplitMix64::new(11);
    for f in [WeightFormat::Fp8Block, WeightFormat::Fp8Channel, WeightFormat::Mxfp8] {
        let mut matrix = || {
            let w: Vec<f32> = (0..rows * cols).map(|_| r.gaussian()).collect();
            BF16.pack(&QuantMatrix::quantize(f, rows, cols, &w).unwrap()).unwrap()
        };
        let (gate, up, down) = (matrix(), matrix(), matrix());
        for n in [17, 25, 40] {
            let x: Vec<bf16> = (0..n * cols).map(|_| bf16::from_f32(r.gaussian())).collect();
            let ids: Vec<u32> = (0..n as u32).collect();
            let shape = TaskShape { format: LayerFormat { gate: f, up: f, down: f }, tokens: n, rows, cols };
            let mut scratch = vec![0u8; BF16.scratch_bytes(shape)];
            assert!(scratch.len() >= 2 * 2 * cols / 4 * 128, "{f}: scratch for gate's and up's stages");
            let mut act = vec![0u8; BF16.act_bytes(f, n, cols)];
            BF16.quantize_act(f, cols, &x, &ids, &mut act, &mut scratch);
            let run = |scratch: &mut [u8]| {
                let (mut h, mut y) = (vec![bf16::ZERO; n * rows], vec![0f32; n * rows]);
                let hm = MatMut::from_slice(&mut h, n, rows, rows);
                BF16.gate_up(&gate, &up, 0..rows, &act, &act, Glu::SILU, None, hm, scratch);
                BF16.down(&down, 0..rows, &act, MatMut::from_slice(&mut y, n, rows, rows), scratch);
                (h, y)
            };
            let ((h, y), (want_h, want_y)) = (run(&mut scratch), run(&mut []));
            for (what, same) in [
                ("gate/up", h.iter().zip(&want_h).all(|(a, b)| a.to_bits() == b.to_bits())),
                ("down", y.iter().zip(&want_y).all(|(a, b)| a.to_bits() == b.to_bits())),
            ] {
                assert!(same, "{f}, {n} tokens: {what} staged differs from decoding tiles");
            }
        }
    }
}
