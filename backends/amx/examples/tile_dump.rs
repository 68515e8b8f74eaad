//! Record what the hardware's tile products give, to check the emulator's model against:
//! `cargo run --release -p kt-backend-amx --example tile_dump -- OUT.bin`. Each record is
//! 4 tiles of 1024 bytes (A, B, C before, C after) after a 4-byte header (op: 0 tdpbf16ps,
//! 1 tdpbusd, 2 tdpbssd; dwords of K; input family; 0). A is 16 × 4K bytes, B K × 64, C 16 × 16.
//! `tests/data/hardware_tiles.bin` holds 38 of the records one run wrote (the families of
//! `tdpbf16ps` at one pair and a whole tile, both int8 kinds), which the emulator must match.
use kt_backend_amx::tile::{self, Amx};
use kt_core::backend::Backend;
use kt_core::rng::SplitMix64;
use std::io::Write;

/// `0..n` (modulo, as the committed records were drawn).
fn below(r: &mut SplitMix64, n: u64) -> u64 {
    r.next_u64() % n
}

/// A bf16 with a random sign and mantissa and an exponent in `lo..hi` (biased).
fn bf16(r: &mut SplitMix64, lo: u64, hi: u64) -> u16 {
    let e = lo + below(r, hi - lo);
    ((below(r, 2) << 15) | (e << 7) | below(r, 128)) as u16
}

fn f32_bits(r: &mut SplitMix64, lo: u64, hi: u64) -> u32 {
    let e = lo + below(r, hi - lo);
    ((below(r, 2) << 31) | (e << 23) | below(r, 1 << 23)) as u32
}

fn main() {
    let out = std::env::args().nth(1).expect("usage: tile_dump OUT.bin");
    if let Err(why) = kt_backend_amx::AMX.cpu_support() {
        eprintln!("no AMX: {why}");
        std::process::exit(2);
    }
    let mut f = std::io::BufWriter::new(std::fs::File::create(&out).unwrap());
    let mut r = SplitMix64::new(7);
    let mut t = Amx;
    let mut records = 0;
    for op in 0u8..3 {
        for kd in [1usize, 2, 16] {
            for family in 0u8..6 {
                if op > 0 && family > 1 {
                    continue;
                }
                let reps = if op == 0 { 60 } else { 20 };
                for _ in 0..reps {
                    let (mut a, mut b, mut c) = ([0u8; 1024], [0u8; 1024], [0u8; 1024]);
                    if op == 0 {
                        // families: 0 near 1, 1 wide exponents, 2 cancelling pairs, 3 C much
                        // larger than the products, 4 tiny (denormal inputs and results), 5 C
                        // zero with mixed magnitudes
                        let (lo, hi) = match family {
                            0 => (124, 131),
                            1 => (100, 155),
                            4 => (0, 70),
                            _ => (118, 137),
                        };
                        for m in 0..16 {
                            for j in 0..2 * kd {
                                let v = bf16(&mut r, lo, hi);
                                a[m * 64 + 2 * j..m * 64 + 2 * j + 2].copy_from_slice(&v.to_le_bytes());
                            }
                        }
                        for k in 0..kd {
                            for n in 0..16 {
                                for i in 0..2 {
                                    let mut v = bf16(&mut r, lo, hi);
                                    if family == 2 && i == 1 {
                                        // b1 = -b0 · a0/a1 roughly, by copying b0 negated onto
                                        // the pair whose a's are equal in row 0
                                        v = u16::from_le_bytes([b[k * 64 + 4 * n], b[k * 64 + 4 * n + 1]]) ^ 0x8000;
                                        v ^= below(&mut r, 4) as u16;
                                    }
                                    let at = k * 64 + 4 * n + 2 * i;
                                    b[at..at + 2].copy_from_slice(&v.to_le_bytes());
                                }
                            }
                        }
                        if family == 2 {
                            for m in 0..16 {
                                for k in 0..kd {
                                    let x = [a[m * 64 + 4 * k], a[m * 64 + 4 * k + 1]];
                                    a[m * 64 + 4 * k + 2..m * 64 + 4 * k + 4].copy_from_slice(&x);
                                }
                            }
                        }
                        for i in 0..256 {
                            let v = match family {
                                3 => f32_bits(&mut r, 140, 155),
                                4 => f32_bits(&mut r, 0, 8) & 0x807f_ffff | (below(&mut r, 2) as u32) << 23,
                                5 => 0,
                                _ => f32_bits(&mut r, 118, 137),
                            };
                            c[4 * i..4 * i + 4].copy_from_slice(&v.to_le_bytes());
                        }
                    } else {
                        for x in a.iter_mut().chain(b.iter_mut()) {
                            *x = r.next_u64() as u8;
                        }
                        for i in 0..256 {
                            let v = if family == 0 { r.next_u64() as u32 >> 8 } else { r.next_u64() as u32 };
                            c[4 * i..4 * i + 4].copy_from_slice(&v.to_le_bytes());
                        }
                    }
                    // SAFETY: AMX is present and permitted (cpu_support).
                    let after = unsafe { tile::product(&mut t, op, kd, &a, &b, &c) };
                    f.write_all(&[op, kd as u8, family, 0]).unwrap();
                    for x in [&a, &b, &c, &after] {
                        f.write_all(x).unwrap();
                    }
                    records += 1;
                }
            }
        }
    }
    tile::release();
    f.flush().unwrap();
    println!("{records} records in {out}");
}
