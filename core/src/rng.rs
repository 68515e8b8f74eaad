//! A small seeded generator (SplitMix64) for synthetic weights, inputs and tests: fast,
//! splittable by seed so that parallel generation is deterministic.
#![forbid(unsafe_code)]

use alloc::vec::Vec;

/// SplitMix64 (Steele, Lea, Flood 2014).
#[derive(Clone, Debug)]
pub struct SplitMix64(u64);

impl SplitMix64 {
    /// A generator from a seed.
    pub fn new(seed: u64) -> Self {
        SplitMix64(seed)
    }

    /// A generator for stream `i` of `seed`, independent of the others for practical purposes.
    pub fn stream(seed: u64, i: u64) -> Self {
        let mut s = SplitMix64(seed ^ i.wrapping_mul(0xD1B5_4A32_D192_ED03));
        s.next_u64();
        s
    }

    /// The next 64 random bits.
    #[inline]
    pub fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    /// Uniform in `[0, 1)`.
    #[inline]
    pub fn next_f32(&mut self) -> f32 {
        (self.next_u64() >> 40) as f32 * (1.0 / (1u64 << 24) as f32)
    }

    /// Uniform in `[-a, a)`.
    #[inline]
    pub fn uniform(&mut self, a: f32) -> f32 {
        (2.0 * self.next_f32() - 1.0) * a
    }

    /// Uniform integer in `0..n` (n > 0).
    #[inline]
    pub fn below(&mut self, n: usize) -> usize {
        (((self.next_u64() >> 32) * n as u64) >> 32) as usize
    }

    /// Standard normal (Box-Muller).
    pub fn gaussian(&mut self) -> f32 {
        let u1 = 1.0 - self.next_f32(); // (0, 1]
        let u2 = self.next_f32();
        libm::sqrtf(-2.0 * libm::logf(u1)) * libm::cosf(core::f32::consts::TAU * u2)
    }
}

/// Distinct random experts per token with positive weights summing to 1.
pub fn random_routing(tokens: usize, k: usize, experts: usize, seed: u64) -> (Vec<i64>, Vec<f32>) {
    let mut r = SplitMix64::new(seed);
    let mut ids = Vec::with_capacity(tokens * k);
    let mut w = Vec::with_capacity(tokens * k);
    for _ in 0..tokens {
        let mut pool: Vec<i64> = (0..experts as i64).collect();
        let ws = routing_weights(&mut r, k);
        for (j, wj) in ws.into_iter().enumerate() {
            let pick = j + r.below(experts - j);
            pool.swap(j, pick);
            ids.push(pool[j]);
            w.push(wj);
        }
    }
    (ids, w)
}

/// One token's `k` routing weights drawn from `r`: each above 0, summing to 1.
pub fn routing_weights(r: &mut SplitMix64, k: usize) -> Vec<f32> {
    let ws: Vec<f32> = (0..k).map(|_| 0.1 + r.next_f32()).collect();
    let sum: f32 = ws.iter().sum();
    ws.iter().map(|x| x / sum).collect()
}
