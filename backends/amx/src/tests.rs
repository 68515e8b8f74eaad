//! The conformance suite on emulated tiles (any CPU with AVX-512) and on the hardware (AMX
//! CPUs), and the same bits from tiles and from the AVX-512 kernels where the arithmetic is
//! exact integers.

use kt_core::rng::SplitMix64;
use kt_core::testing::{layer_outputs, Scenario};
use kt_core::{Backend, MoeConfig, WeightFormat};

use crate::imp::{EMULATED, EMULATED_ALL};

mod emulated {
    kt_core::conformance_suite!(&crate::imp::EMULATED);
}
mod emulated_all {
    kt_core::conformance_suite!(&crate::imp::EMULATED_ALL);
}
mod hardware {
    kt_core::conformance_suite!(&crate::AMX);
}

/// The integer formats on tiles give the AVX-512 kernels' bits at every token count from 1 to
/// 70 (one and three token halves, short last blocks): per-row int8 and int4 in KT's order
/// across K blocks (3712 and 7424 columns) and in panels (int8 with 192 rows: K of down not
/// KT's), the K-group kinds in panels.
#[test]
fn tiles_give_the_avx512_kernels_bits() {
    let Ok(()) = EMULATED_ALL.cpu_support() else {
        eprintln!("skipped: this CPU lacks the AVX-512 the emulated backend runs beside");
        return;
    };
    let simd: &'static dyn Backend = &kt_backend_avx512::AVX512_BF16;
    let mut backends: Vec<&'static dyn Backend> = vec![&EMULATED_ALL];
    match crate::AMX.cpu_support() {
        Ok(()) => backends.push(&crate::AMX),
        Err(why) => eprintln!("hardware tiles skipped: this CPU lacks {why}"),
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

/// The emulated tiles against the hardware's, bit for bit, bf16 included, where both run.
#[test]
fn the_emulator_gives_the_hardwares_bits() {
    if let Err(why) = crate::AMX.cpu_support() {
        eprintln!("skipped: this CPU lacks {why}");
        return;
    }
    let mut r = SplitMix64::new(5);
    for f in WeightFormat::ALL {
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
