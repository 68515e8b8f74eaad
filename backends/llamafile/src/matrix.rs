//! [`Matrix`]: a packed GGML matrix with the kernels chosen for it, once, when it was packed.

use core::ops::Range;

use kt_core::ggml::GgmlType;

use crate::kernels::{Kernels, Packed, Scratch, R};
use crate::vnni::Vnni;

/// A matrix packed for the kernels and its type's instances of them.
pub struct Matrix {
    /// The packed blocks.
    pub w: Packed,
    kernels: Kernels,
}

impl Matrix {
    /// GGUF bytes `src` of a `rows × cols` matrix of type `t`, packed for VNNI encoding `vnni`
    /// where its type has kernels for it ([`Packed::new`]).
    pub fn pack(t: GgmlType, rows: usize, cols: usize, src: &[u8], vnni: Option<Vnni>) -> Matrix {
        Matrix { w: Packed::new(t, rows, cols, src, vnni), kernels: Kernels::of(t) }
    }

    /// `out[t][i] = row r0+i · token t` for `i < nr ≤ R`, `t < n`, two tokens or more.
    ///
    /// # Safety
    /// AVX2, FMA and F16C must be present, and the features of the VNNI encoding it was packed
    /// for; `act` must hold `n` tokens prepared by [`crate::act`] (for VNNI as it was).
    #[allow(clippy::too_many_arguments)]
    #[inline]
    pub unsafe fn panel_run(
        &self,
        r0: usize,
        nr: usize,
        act: &[u8],
        n: usize,
        out: &mut [[f32; R]],
        scratch: &mut Scratch,
    ) {
        // SAFETY: the caller's contract, which is the kernel's.
        unsafe { (self.kernels.panel_run)(&self.w, r0, nr, act, n, out, scratch) }
    }

    /// `out[i] = row rows.start+i · the one token` for the rows `rows`.
    ///
    /// # Safety
    /// As [`Matrix::panel_run`], for one token.
    #[inline]
    pub unsafe fn gemv(&self, rows: Range<usize>, act: &[u8], out: &mut [f32]) {
        // SAFETY: the caller's contract, which is the kernel's.
        unsafe { (self.kernels.gemv)(&self.w, rows, act, out) }
    }
}
