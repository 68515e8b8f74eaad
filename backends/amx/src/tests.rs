//! The conformance suite on emulated tiles (any CPU with AVX-512) and on the hardware (AMX
//! CPUs), and the same bits from tiles and from the AVX-512 kernels where the arithmetic is
//! exact integers.

use kt_core::rng::SplitMix64;
use kt_core::testing::{layer_outputs, Scenario};
use kt_core::{Backend, MoeConfig, WeightFormat};

use crate::imp::{EMULATED, EMULATED_ALL};
use crate::tile::{product, Amx, Emulator};

mod emulated {
    kt_core::conformance_suite!(&crate::imp::EMULATED);
}
mod emulated_all {
    kt_core::conformance_suite!(&crate::imp::EMULATED_ALL);
}
mod hardware {
    kt_core::conformance_suite!(&crate::AMX);
}
mod hardware_all {
    kt_core::conformance_suite!(&crate::imp::HARDWARE_ALL);
}

/// The default thresholds (`kernels::measured_tile_from`): the formats the tiles lose on report
/// the AVX-512 kernels' instructions, the others the tiles'; an explicit threshold puts every
/// format with tile kernels on them.
#[test]
fn instructions_follow_the_measured_thresholds() {
    use kt_core::backend::Instructions::{AmxBf16, AmxInt8};
    if crate::tile::tile_from_env().is_some() {
        eprintln!("skipped: KT_AMX_TILE_FROM is set, in place of the measured thresholds");
        return;
    }
    let tiles = [
        (WeightFormat::Int8Row, AmxInt8),
        (WeightFormat::Int4Row, AmxInt8),
        (WeightFormat::Int4Group { group: 128 }, AmxInt8),
        (WeightFormat::Bf16, AmxBf16),
        (WeightFormat::Fp8Block, AmxBf16),
        (WeightFormat::Mxfp8, AmxBf16),
    ];
    for (f, family) in tiles {
        assert_eq!(EMULATED.instructions(f), family, "{f}");
    }
    for f in [WeightFormat::Int4Group { group: 32 }, WeightFormat::Int4Group { group: 64 }, WeightFormat::Mxfp4] {
        // The AVX-512 kernels' `vpdpbusd`.
        assert_eq!(EMULATED.instructions(f), kt_core::backend::Instructions::Int8Vnni, "{f}");
        assert_eq!(EMULATED_ALL.instructions(f), AmxInt8, "{f}");
    }
}

/// The integer formats on tiles give the AVX-512 kernels' bits at every token count from 1 to
/// 70 (one and three token halves, short last blocks): per-row int8 and int4 in KT's order
/// across K blocks (3712 and 7424 columns) and in panels (int8 with 192 rows: K of down not
/// KT's), the K-group kinds in panels.
#[test]
fn tiles_give_the_avx512_kernels_bits() {
    let Ok(()) = EMULATED_ALL.cpu_support() else {
        kt_core::skip_isa!("AVX-512, which the emulated backend runs beside");
        return;
    };
    let simd: &'static dyn Backend = &crate::imp::VECTOR;
    let mut backends: Vec<&'static dyn Backend> = vec![&EMULATED_ALL];
    match crate::AMX.cpu_support() {
        Ok(()) => backends.push(&crate::imp::HARDWARE_ALL),
        Err(why) => kt_core::skip_isa!(format!("{why} (the hardware tiles)")),
    }
    let cases = [
        (WeightFormat::Int8Row, 3712, 128),
        (WeightFormat::Int4Row, 7424, 128),
        (WeightFormat::Int8Row, 192, 96),
        (WeightFormat::Int4Group { group: 32 }, 256, 96),
        (WeightFormat::Int4Group { group: 64 }, 384, 128),
        (WeightFormat::Int4Group { group: 128 }, 256, 256),
        (WeightFormat::Mxfp4, 192, 160),
    ];
    for (f, h, i) in cases {
        let cfg = MoeConfig { max_tokens: 70, ..MoeConfig::new(3, 1, h, i) };
        for tokens in (1..=70).step_by(if h > 1000 { 7 } else { 1 }) {
            let want = layer_outputs(simd, f, &cfg, tokens, Scenario::Skewed);
            for &b in &backends {
                let got = layer_outputs(b, f, &cfg, tokens, Scenario::Skewed);
                let same = got.iter().zip(&want).all(|(a, b)| a.to_bits() == b.to_bits());
                assert!(same, "{} differs from avx512_bf16 on {f} {h}x{i}, {tokens} tokens", b.name());
            }
        }
    }
}

/// Experts of more token blocks than one group keeps in L2 (int8 and int4 activation rows of
/// 7168 bytes: four blocks a group) give the AVX-512 kernels' bits too: the groups split the
/// blocks, never a block's K.
#[test]
fn token_groups_give_the_avx512_kernels_bits() {
    let Ok(()) = EMULATED_ALL.cpu_support() else {
        kt_core::skip_isa!("AVX-512, which the emulated backend runs beside");
        return;
    };
    let mut backends: Vec<&'static dyn Backend> = vec![&EMULATED_ALL];
    match crate::AMX.cpu_support() {
        Ok(()) => backends.push(&crate::imp::HARDWARE_ALL),
        Err(why) => kt_core::skip_isa!(format!("{why} (the hardware tiles)")),
    }
    for f in [WeightFormat::Int8Row, WeightFormat::Int4Row] {
        let cfg = MoeConfig { max_tokens: 200, ..MoeConfig::new(1, 1, 7168, 64) };
        for tokens in [129, 200] {
            let want = layer_outputs(&crate::imp::VECTOR, f, &cfg, tokens, Scenario::Random);
            for &b in &backends {
                let got = layer_outputs(b, f, &cfg, tokens, Scenario::Random);
                let same = got.iter().zip(&want).all(|(a, b)| a.to_bits() == b.to_bits());
                assert!(same, "{} differs from avx512_bf16 on {f}, {tokens} tokens", b.name());
            }
        }
    }
}

/// Acc products recorded on AMX hardware (`examples/tile_dump.rs`, a Sapphire Rapids-class
/// Xeon): `tdpbf16ps` with K of one bf16 pair (every input family: near one, wide exponents,
/// cancelling pairs, C far larger, denormals and underflow, C zero) and of a whole tile, and
/// `tdpbusd`/`tdpbssd` over a whole tile. Each record is a 4-byte header (op: 0 `tdpbf16ps`,
/// 1 `tdpbusd`, 2 `tdpbssd`; K in dwords; input family; 0) and the A, B, C-before and
/// C-after tiles, 16 rows of 64 bytes each.
const HARDWARE_TILES: &[u8] = include_bytes!("../tests/data/hardware_tiles.bin");

/// The emulator's C-after against the hardware's: the same bits for the integer products and
/// for `tdpbf16ps` over one pair; over more pairs (where the hardware sums in an order of its
/// own) within twice the bound any order of 2·kd rounded f32 additions obeys,
/// 2·(2·kd)·2⁻²⁴·(|C| + Σ|products|), checked per output. `Err` names the first that is not.
fn check_against_emulator(
    op: u8,
    kd: usize,
    a: &[u8; 1024],
    b: &[u8; 1024],
    c: &[u8; 1024],
    hw: &[u8],
) -> Result<(), String> {
    // SAFETY: the emulator runs anywhere.
    let emu = unsafe { product(&mut Emulator::default(), op, kd, a, b, c) };
    if op != 0 || kd == 1 {
        return if emu[..] == hw[..] { Ok(()) } else { Err(format!("op {op}, K {kd} dwords: bits differ")) };
    }
    let f32_at = |t: &[u8], at: usize| f32::from_le_bytes(t[at..at + 4].try_into().unwrap());
    let bf16_at = |t: &[u8], at: usize| f32::from_bits(u32::from(u16::from_le_bytes([t[at], t[at + 1]])) << 16);
    for m in 0..16 {
        for n in 0..16 {
            let magnitude = (0..kd)
                .flat_map(|k| (0..2).map(move |i| (k, i)))
                .map(|(k, i)| (bf16_at(a, m * 64 + 4 * k + 2 * i) * bf16_at(b, k * 64 + 4 * n + 2 * i)).abs())
                .sum::<f32>()
                + f32_at(c, m * 64 + 4 * n).abs();
            let (e, h) = (f32_at(&emu, m * 64 + 4 * n), f32_at(hw, m * 64 + 4 * n));
            let bound = 4.0 * kd as f32 * f32::EPSILON / 2.0 * magnitude;
            if (e - h).abs() > bound {
                return Err(format!(
                    "tdpbf16ps, K {kd} dwords, C[{m}][{n}]: emulator {e}, hardware {h}, bound {bound}"
                ));
            }
        }
    }
    Ok(())
}

/// The emulator against the recorded hardware products: every machine checks the model the
/// emulated conformance runs rest on.
#[test]
fn the_emulator_matches_the_recorded_hardware_products() {
    let records: Vec<&[u8]> = HARDWARE_TILES.chunks_exact(4 + 4 * 1024).collect();
    assert_eq!(records.len(), 38);
    for rec in records {
        let (op, kd, family) = (rec[0], usize::from(rec[1]), rec[2]);
        let tile = |i: usize| -> &[u8; 1024] { rec[4 + 1024 * i..4 + 1024 * (i + 1)].try_into().unwrap() };
        let checked = check_against_emulator(op, kd, tile(0), tile(1), tile(2), tile(3));
        assert!(checked.is_ok(), "input family {family}: {}", checked.unwrap_err());
    }
}

/// The emulator against this CPU's tiles where it has AMX: random tile products (bf16 over one
/// pair and a whole tile, both int8 kinds), then whole layers of the integer formats bit for bit
/// (the bf16-tile formats meet the reference in `hardware::conformance`; their bf16 rounding of
/// the SwiGLU output turns last-bit differences into larger ones).
#[test]
fn the_emulator_gives_the_hardwares_bits() {
    kt_core::skip_unless_runs!(&crate::AMX);
    let mut r = SplitMix64::new(5);
    for (op, kd) in [(0, 1), (0, 16), (1, 16), (2, 16)] {
        for _ in 0..20 {
            let mut tiles = [[0u8; 1024]; 3];
            for t in &mut tiles {
                for x in t.chunks_exact_mut(2) {
                    // bf16 (and C's f32 halves) of random sign, mantissa and an exponent within
                    // 2^±8 of one's for tdpbf16ps; any bytes for the int8 kinds.
                    let v = r.next_u64();
                    let v = if op == 0 { (v & 0x807f | (119 + (v >> 16) % 16) << 7) as u16 } else { v as u16 };
                    x.copy_from_slice(&v.to_le_bytes());
                }
            }
            let [a, b, c] = &tiles;
            // SAFETY: AMX is present and permitted (cpu_support, above).
            let hw = unsafe { product(&mut Amx, op, kd, a, b, c) };
            crate::tile::release();
            let checked = check_against_emulator(op, kd, a, b, c, &hw);
            assert!(checked.is_ok(), "{}", checked.unwrap_err());
        }
    }
    for f in WeightFormat::ALL.into_iter().filter(|f| f.int_activations()) {
        let cfg = MoeConfig { max_tokens: 40, ..MoeConfig::new(4, 2, 256, 384) };
        for tokens in [4, 17, 40] {
            let s = [Scenario::Random, Scenario::Skewed][r.next_u64() as usize % 2];
            let want = layer_outputs(&EMULATED, f, &cfg, tokens, s);
            let got = layer_outputs(&crate::AMX, f, &cfg, tokens, s);
            let same = got.iter().zip(&want).all(|(a, b)| a.to_bits() == b.to_bits());
            assert!(same, "amx differs from the emulator on {f}, {tokens} tokens");
        }
    }
}
