//! Routing input of one forward: top-k expert ids and weights per token, plus the GPU mask.
#![forbid(unsafe_code)]

use crate::{Error, MoeConfig};

/// Borrowed routing of `n` tokens: `ids[n,k]`, `weights[n,k]`, optional `gpu_mask[E]`.
///
/// An id is **skipped** when it is negative, `>= E`, or its mask bit is set (the expert runs on
/// the GPU). Skipped slots contribute nothing; a token whose slots are all skipped outputs 0.
/// Duplicate ids in one row are computed independently, as KT does.
#[derive(Clone, Copy, Debug)]
pub struct Routing<'a> {
    /// Tokens.
    pub tokens: usize,
    /// Slots per token (top-k).
    pub k: usize,
    /// Expert ids, row-major `[tokens, k]`.
    pub ids: &'a [i64],
    /// Routing weights, row-major `[tokens, k]`, used as given (no renormalisation).
    pub weights: &'a [f32],
    /// `true` = expert computed on the GPU, skipped here. `None` = every expert on the CPU.
    pub gpu_mask: Option<&'a [bool]>,
}

impl<'a> Routing<'a> {
    /// Check lengths and counts against the layer config.
    pub fn validate(&self, cfg: &MoeConfig) -> Result<(), Error> {
        if self.k != cfg.top_k {
            return Err(Error::ShapeMismatch { what: "topk_ids columns (k)", expected: cfg.top_k, found: self.k });
        }
        if self.tokens > cfg.max_tokens {
            return Err(Error::TooManyTokens { tokens: self.tokens, max: cfg.max_tokens });
        }
        let nk = self.tokens * self.k;
        if self.ids.len() != nk {
            return Err(Error::ShapeMismatch { what: "topk_ids", expected: nk, found: self.ids.len() });
        }
        if self.weights.len() != nk {
            return Err(Error::ShapeMismatch { what: "topk_weights", expected: nk, found: self.weights.len() });
        }
        if let Some(m) = self.gpu_mask {
            if m.len() != cfg.experts {
                return Err(Error::ShapeMismatch { what: "gpu_experts_mask", expected: cfg.experts, found: m.len() });
            }
        }
        Ok(())
    }

    /// The expert of slot `(t, j)` if it runs on the CPU, `None` if skipped.
    #[inline]
    pub fn expert(&self, t: usize, j: usize, experts: usize) -> Option<usize> {
        let id = self.ids[t * self.k + j];
        if id < 0 || id >= experts as i64 {
            return None;
        }
        let e = id as usize;
        match self.gpu_mask {
            Some(m) if m[e] => None,
            _ => Some(e),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn skips_negative_out_of_range_and_masked() {
        let ids = [0i64, -1, 7, 8, 3, 3];
        let w = [1.0f32; 6];
        let mask = [false, false, false, true, false, false, false, false];
        let r = Routing { tokens: 3, k: 2, ids: &ids, weights: &w, gpu_mask: Some(&mask) };
        let cfg = MoeConfig::new(8, 2, 8, 8);
        r.validate(&cfg).unwrap();
        let got: alloc::vec::Vec<_> =
            (0..3).flat_map(|t| (0..2).map(move |j| (t, j))).map(|(t, j)| r.expert(t, j, 8)).collect();
        assert_eq!(got, [Some(0), None, Some(7), None, None, None]);
    }

    #[test]
    fn length_errors_name_the_tensor() {
        let cfg = MoeConfig::new(8, 2, 8, 8);
        let r = Routing { tokens: 2, k: 2, ids: &[0, 1, 2], weights: &[1.0; 4], gpu_mask: None };
        assert!(matches!(r.validate(&cfg), Err(Error::ShapeMismatch { what: "topk_ids", .. })));
    }
}
