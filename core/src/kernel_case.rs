//! One projection's `down` prepared as the forward pass prepares it, for the kernel benches
//! (feature `test-util`): each backend's divan bench times [`KernelCase::run`].

use alloc::vec;
use alloc::vec::Vec;

use half::bf16;

use crate::aligned::AlignedBuf;
use crate::backend::TaskShape;
use crate::forward::y_stride;
use crate::mat::MatMut;
use crate::rng::SplitMix64;
use crate::{Backend, PackedMatrix, QuantMatrix};

/// A matrix packed by a backend, `tokens` Gaussian inputs (seed `seed`) prepared by it in
/// 64-byte-aligned buffers, and outputs whose rows are one line more than a row apart: what
/// the forward pass hands the kernels.
pub struct KernelCase {
    backend: &'static dyn Backend,
    w: PackedMatrix,
    act: AlignedBuf,
    scratch: AlignedBuf,
    y: Vec<f32>,
    tokens: usize,
}

impl KernelCase {
    /// `m` packed by `backend` against `tokens` inputs of seed `seed`.
    pub fn new(backend: &'static dyn Backend, m: &QuantMatrix, tokens: usize, seed: u64) -> KernelCase {
        KernelCase::packed(backend, backend.pack(m).expect("the backend serves the matrix"), tokens, seed)
    }

    /// `w`, packed by `backend` (or as it packs), against `tokens` inputs of seed `seed`.
    pub fn packed(backend: &'static dyn Backend, w: PackedMatrix, tokens: usize, seed: u64) -> KernelCase {
        let (format, rows, cols) = (w.format(), w.rows(), w.cols());
        let mut r = SplitMix64::new(seed);
        let x: Vec<bf16> = (0..tokens * cols).map(|_| bf16::from_f32(r.gaussian())).collect();
        let ids: Vec<u32> = (0..tokens as u32).collect();
        let mut act = AlignedBuf::zeroed(backend.act_bytes(format, tokens, cols));
        let shape = TaskShape { format: format.into(), tokens, rows, cols };
        let mut scratch = AlignedBuf::zeroed(backend.scratch_bytes(shape));
        backend.quantize_act(format, cols, &x, &ids, act.as_mut_slice(), scratch.as_mut_slice());
        let y = vec![0.0; tokens * y_stride(rows)];
        KernelCase { backend, w, act, scratch, y, tokens }
    }

    /// Operations one [`run`](Self::run) does: 2 · rows · cols · tokens.
    pub fn ops(&self) -> usize {
        2 * self.w.rows() * self.w.cols() * self.tokens
    }

    /// Token `t`'s outputs of the last [`run`](Self::run), one a matrix row.
    pub fn outputs(&self, t: usize) -> &[f32] {
        let rows = self.w.rows();
        &self.y[t * y_stride(rows)..][..rows]
    }

    /// Every row of the matrix against every token, as one task.
    pub fn run(&mut self) {
        let rows = self.w.rows();
        let y = MatMut::from_slice(&mut self.y, self.tokens, rows, y_stride(rows));
        self.backend.down(&self.w, 0..rows, self.act.as_slice(), y, self.scratch.as_mut_slice());
    }
}
