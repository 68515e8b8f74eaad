//! Shared helpers of the integration tests.

use kt_core::testing::{random_experts, Expert};
use kt_core::MoeConfig;

/// Random Gaussian experts as the owned `[gate, up, down]` that `MoeLayer::from_f32` takes.
pub fn experts(cfg: &MoeConfig, seed: u64) -> Vec<Expert> {
    random_experts(cfg, seed)
}

/// `MoeLayer::from_f32`'s expert closure over a list of experts, skipping `masked` ones.
pub fn owned<'a>(xs: &'a [Expert], masked: &'a [usize]) -> impl Fn(usize) -> Option<[Vec<f32>; 3]> + Sync + 'a {
    move |e| (!masked.contains(&e)).then(|| xs[e].clone())
}
