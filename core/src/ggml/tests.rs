use alloc::vec;
use alloc::vec::Vec;

use super::*;
use crate::rng::SplitMix64 as Rng;

fn random_row(n: usize, seed: u64) -> Vec<f32> {
    let mut rng = Rng::new(seed);
    (0..n).map(|_| rng.gaussian() * 0.05).collect()
}

/// Mean |error| relative to mean |x| after a quantize/dequantize round trip.
fn round_trip_error(t: GgmlType, x: &[f32]) -> f32 {
    let mut bytes = vec![0u8; t.row_bytes(x.len())];
    quantize_row(t, x, &mut bytes).unwrap();
    let mut y = vec![0.0f32; x.len()];
    dequantize_row(t, &bytes, &mut y);
    let err: f32 = x.iter().zip(&y).map(|(a, b)| (a - b).abs()).sum();
    err / x.iter().map(|v| v.abs()).sum::<f32>()
}

#[test]
fn quantizers_round_trip_within_their_precision() {
    let x = random_row(4096, 1);
    for (t, bound) in [
        (GgmlType::F32, 0.0),
        (GgmlType::F16, 1e-3),
        (GgmlType::BF16, 4e-3),
        (GgmlType::Q8_0, 6e-3),
        (GgmlType::Q4_0, 0.12),
        (GgmlType::Q4_K, 0.09),
    ] {
        let e = round_trip_error(t, &x);
        assert!(e <= bound, "{t}: {e}");
    }
}

#[test]
fn q4k_fit_beats_plain_min_max() {
    // The refit must not be worse than Q4_0 on the same data (Q4_K has finer scales).
    let x = random_row(2048, 2);
    assert!(round_trip_error(GgmlType::Q4_K, &x) < round_trip_error(GgmlType::Q4_0, &x));
}

#[test]
fn q4k_scale_packing_round_trips() {
    let sc = [0, 1, 17, 63, 32, 5, 60, 41];
    let m = [63, 0, 2, 33, 47, 16, 9, 1];
    let q = pack_scale_min_k4(&sc, &m);
    for j in 0..8 {
        assert_eq!(scale_min_k4(j, &q), (sc[j], m[j]), "{j}");
    }
}

#[test]
fn q8k_sums_and_scale() {
    let x = random_row(256, 3);
    let b = BlockQ8K::quantize(&x);
    for (j, s) in b.bsums.iter().enumerate() {
        assert_eq!(*s, b.qs[16 * j..16 * j + 16].iter().map(|&v| i16::from(v)).sum::<i16>());
    }
    let amax = x.iter().fold(0.0f32, |m, v| m.max(v.abs()));
    assert_eq!(b.qs.iter().map(|v| v.unsigned_abs()).max(), Some(127));
    assert_eq!(b.d, amax / 127.0);
}

#[test]
fn q8_0_rounds_ties_away_from_zero() {
    // amax 127 → d = 1: 2.5 → 3 and -2.5 → -3 (ties to even would give 2 and -2).
    let mut x = [0.0f32; 32];
    (x[0], x[1], x[2]) = (127.0, 2.5, -2.5);
    let b = BlockQ8_0::quantize(&x);
    assert_eq!((b.qs[1], b.qs[2]), (3, -3));
}

#[test]
fn zero_rows_quantize_to_zero() {
    for &t in GgmlType::ALL.iter().filter(|t| t.can_quantize()) {
        let x = vec![0.0f32; 512];
        let mut bytes = vec![0u8; t.row_bytes(512)];
        quantize_row(t, &x, &mut bytes).unwrap();
        let mut y = vec![1.0f32; 512];
        dequantize_row(t, &bytes, &mut y);
        assert!(y.iter().all(|&v| v == 0.0), "{t}");
    }
}

#[test]
fn names_and_ids_round_trip() {
    for &t in GgmlType::ALL {
        assert_eq!(GgmlType::from_id(t as u32), Some(t));
        assert_eq!(GgmlType::parse(&t.name().to_ascii_uppercase()), Some(t));
        assert_eq!(id_name(t as u32), t.name());
    }
    assert_eq!(GgmlType::parse("iq4-xs"), Some(GgmlType::IQ4_XS));
    assert_eq!(GgmlType::from_id(15), None);
    assert_eq!(id_name(15), "q8_K");
}

#[test]
fn block_structs_have_ggml_sizes() {
    use core::mem::size_of;
    for (t, size) in [
        (GgmlType::Q4_0, size_of::<BlockQ4_0>()),
        (GgmlType::Q4_1, size_of::<BlockQ4_1>()),
        (GgmlType::Q5_0, size_of::<BlockQ5_0>()),
        (GgmlType::Q5_1, size_of::<BlockQ5_1>()),
        (GgmlType::Q8_0, size_of::<BlockQ8_0>()),
        (GgmlType::Q2_K, size_of::<BlockQ2K>()),
        (GgmlType::Q3_K, size_of::<BlockQ3K>()),
        (GgmlType::Q4_K, size_of::<BlockQ4K>()),
        (GgmlType::Q5_K, size_of::<BlockQ5K>()),
        (GgmlType::Q6_K, size_of::<BlockQ6K>()),
        (GgmlType::IQ4_NL, size_of::<BlockIq4Nl>()),
        (GgmlType::MXFP4, size_of::<BlockMxfp4>()),
        (GgmlType::IQ4_XS, size_of::<BlockIq4Xs>()),
        (GgmlType::IQ1_S, size_of::<BlockIq1S>()),
        (GgmlType::IQ1_M, size_of::<BlockIq1M>()),
        (GgmlType::IQ2_XXS, size_of::<BlockIq2Xxs>()),
        (GgmlType::IQ2_XS, size_of::<BlockIq2Xs>()),
        (GgmlType::IQ2_S, size_of::<BlockIq2S>()),
        (GgmlType::IQ3_XXS, size_of::<BlockIq3Xxs>()),
        (GgmlType::IQ3_S, size_of::<BlockIq3S>()),
    ] {
        assert_eq!(t.block_bytes(), size, "{t}");
    }
    assert_eq!(size_of::<BlockQ8K>(), 292);
}

#[test]
fn round_away_is_roundf() {
    let mut x = -300.0f32;
    while x < 300.0 {
        assert_eq!(round_away(x), libm::roundf(x), "{x}");
        x += 0.125;
    }
    for x in [0.49999997f32, -0.49999997, 4194303.5, 4194304.5, 8388607.5, -8388607.5, 1e10, 0.0, -0.0] {
        // Equal as numbers (a zero may differ in sign, which no quantizer can see).
        assert_eq!(round_away(x), libm::roundf(x), "{x}");
    }
}

/// MXFP4's scale `2^(e − 128)` for every code, ggml's subnormals (e < 2) and 255 (2^127) among
/// them; and a block's values its table times that.
#[test]
fn mxfp4_scales_are_powers_of_two_for_every_code() {
    for e in 0..=255u8 {
        assert_eq!(e8m0_half(e), libm::exp2(f64::from(e) - 128.0) as f32, "code {e}");
    }
    let b = BlockMxfp4 { e: 130, qs: core::array::from_fn(|j| (j as u8) | ((15 - j as u8) << 4)) };
    let mut y = [0.0f32; 32];
    b.dequantize(&mut y);
    for j in 0..16 {
        assert_eq!((y[j], y[j + 16]), (4.0 * f32::from(KVALUES_MXFP4[j]), 4.0 * f32::from(KVALUES_MXFP4[15 - j])));
    }
}
